"""Sparse delta messages (FedMatch's communication): thresholding, reconstruction, wire bytes."""

from __future__ import annotations

import math
import pickle

import torch

from fedml_ssfl.algorithms.base import Message, message_nbytes, tensor_nbytes
from fedml_ssfl.sparse import (
    densify,
    density,
    hard_threshold,
    nbytes,
    num_values,
    sparsify,
)


def _mixed_delta(shape=(16, 8, 3, 3), small_frac=0.9, threshold=5e-5, seed=0) -> torch.Tensor:
    """A delta whose entries are mostly below ``threshold`` and some well above it."""
    g = torch.Generator().manual_seed(seed)
    small = (torch.rand(shape, generator=g) * 2 - 1) * threshold * 0.999
    big = torch.randn(shape, generator=g) * 1e-2 + torch.sign(torch.randn(shape, generator=g)) * 2 * threshold
    pick = torch.rand(shape, generator=g) < small_frac
    return torch.where(pick, small, big)


def test_sparse_delta_reconstructs_within_the_threshold_and_is_smaller() -> None:
    thr = 5e-5
    delta = _mixed_delta(threshold=thr)
    enc = sparsify(delta, thr)
    assert enc.is_sparse and enc.shape == (delta.numel(),) and enc.is_coalesced()
    back = densify(enc, delta.shape)
    assert back.shape == delta.shape
    err = (back - delta).abs()
    assert float(err.max()) < thr
    big = delta.abs() >= thr
    assert torch.equal(back[big], delta[big])  # what is kept is kept exactly
    assert torch.all(back[~big] == 0)
    # wire bytes: values (4) + one int64 index (8) per kept entry, far below dense
    kept = int(big.sum())
    assert nbytes(enc) == tensor_nbytes(enc) == 12 * kept
    assert tensor_nbytes(enc) < tensor_nbytes(delta) / 2
    assert num_values(enc) == kept and num_values(delta) == delta.numel()


def test_dense_fallback_sends_the_exact_delta_when_sparse_would_not_be_smaller() -> None:
    thr = 5e-5
    dense_delta = _mixed_delta(small_frac=0.2, threshold=thr)  # ~80 % survive: COO costs 2.4x dense
    enc = sparsify(dense_delta, thr)
    assert not enc.is_sparse and enc.shape == (dense_delta.numel(),)
    assert torch.equal(densify(enc, dense_delta.shape), dense_delta)  # nothing dropped
    assert nbytes(enc) == dense_delta.numel() * 4
    forced = sparsify(dense_delta, thr, dense_fallback=False)
    assert forced.is_sparse and nbytes(forced) > nbytes(enc)
    assert float((densify(forced, dense_delta.shape) - dense_delta).abs().max()) < thr


def test_threshold_zero_is_lossless_and_drops_only_zeros() -> None:
    t = torch.zeros(100)
    t[[3, 50, 99]] = torch.tensor([1e-9, -2.0, 3e-7])
    enc = sparsify(t, 0.0)
    assert enc.is_sparse and num_values(enc) == 3
    assert torch.equal(densify(enc), t)
    empty = sparsify(torch.zeros(5, 4), 1e-5)
    assert empty.is_sparse and nbytes(empty) == 0 and torch.equal(densify(empty, (5, 4)), torch.zeros(5, 4))


def test_non_finite_entries_are_kept_not_dropped() -> None:
    t = torch.zeros(50)
    t[7], t[9] = float("nan"), float("inf")
    back = densify(sparsify(t, 1.0))
    assert math.isnan(float(back[7])) and math.isinf(float(back[9]))


def test_dict_helpers_message_bytes_and_pickling() -> None:
    thr = 1e-5
    deltas = {"conv.weight": _mixed_delta((8, 4, 3, 3), threshold=thr), "fc.bias": _mixed_delta((10,), threshold=thr)}
    wire = {f"psi/{k}": sparsify(v, thr) for k, v in deltas.items()}
    back = {k: densify(wire[f"psi/{k}"], v.shape) for k, v in deltas.items()}
    assert set(back) == set(deltas)
    for k, v in deltas.items():
        assert float((back[k] - v).abs().max()) < thr
    dense_msg = Message(weights={f"psi/{k}": v for k, v in deltas.items()})
    sparse_msg = Message(weights=wire)
    assert message_nbytes(sparse_msg) == sum(nbytes(t) for t in wire.values())
    assert message_nbytes(sparse_msg) < message_nbytes(dense_msg)
    again = pickle.loads(pickle.dumps(sparse_msg))  # how replies travel between processes
    for k, t in wire.items():
        assert torch.equal(densify(again.weights[k]), densify(t))


def test_hard_threshold_and_density() -> None:
    t = torch.tensor([[1e-6, -2e-5, 0.5], [0.0, -1e-7, 3e-5]])
    out = hard_threshold(t, 1e-5)
    assert torch.equal(out, torch.tensor([[0.0, -2e-5, 0.5], [0.0, 0.0, 3e-5]]))
    assert t[0, 0] == 1e-6  # a new tensor
    assert density(out) == 3 / 6 and density(torch.zeros(0)) == 0.0
    assert density(sparsify(out, 0.0)) == 3 / 6
