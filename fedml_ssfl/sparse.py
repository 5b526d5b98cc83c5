"""Sparse delta messages: send ``new - old`` dropping entries too small to matter.

FedMatch (Jeong et al. 2021, Sec. 3.2 and Appendix B.1) sends only the differences of its
parameters, element-wise thresholded, as sparse matrices, in both directions. These helpers do
that for any dict of tensors:

* :func:`sparsify` drops the entries of a delta with ``|d| < threshold`` (and exact zeros) and
  returns a 1-D torch sparse COO tensor over the flattened delta. Flattening makes every
  non-zero cost one int64 index instead of one per dimension (12 bytes per float32 non-zero
  instead of 8 x ndim + 4). Where even that is not smaller than the dense delta
  (density above ~1/3 for float32), ``dense_fallback`` sends the exact dense delta instead:
  never more bytes than dense, and nothing lost.
* :func:`densify` turns either encoding back into a dense tensor of the original shape.
* :func:`hard_threshold` zeroes small entries of a tensor (FedMatch's sparse ``psi``).

Byte counts follow ``algorithms.base.tensor_nbytes``: a sparse COO tensor costs its values plus
its indices. Nothing here imports the algorithm layer.
"""

from __future__ import annotations

import torch

INDEX_BYTES = 8
"""Bytes per index entry of a torch COO tensor (int64 is the only index type torch keeps)."""


def keep_mask(delta: torch.Tensor, threshold: float) -> torch.Tensor:
    """Entries a sparse delta keeps: ``|d| >= threshold`` and non-zero (NaN and inf are kept).

    Keeping non-finite values lets the receiver (e.g. the FedML runtime's reply check) see and
    refuse them instead of having them silently dropped.
    """
    if threshold > 0:  # |d| >= threshold > 0 (or NaN) already means d != 0: one pass fewer, the same mask
        return (delta.abs() < threshold).logical_not_()
    return delta != 0


def sparse_nbytes(nnz: int, element_size: int, ndim: int = 1) -> int:
    """Bytes of a COO tensor with ``nnz`` non-zeros: values plus ``ndim`` int64 indices each."""
    return nnz * (element_size + INDEX_BYTES * ndim)


def sparsify(delta: torch.Tensor, threshold: float, dense_fallback: bool = True, owned: bool = False) -> torch.Tensor:
    """A delta for the wire: a flattened 1-D sparse COO tensor of its entries with ``|d| >= threshold``.

    Parameters
    ----------
    delta : torch.Tensor
        A dense tensor (any shape, any device); the result is on the same device.
    threshold : float
        Entries with ``|d| < threshold`` are dropped (0 drops only exact zeros).
    dense_fallback : bool
        When the COO encoding would not be smaller than the dense one, return the flattened
        dense delta unchanged (exact, never dropping anything).
    owned : bool
        The caller hands ``delta`` over (a temporary nobody else holds or writes to): the dense
        fallback is then ``delta`` flattened, not a copy of it.

    Returns
    -------
    torch.Tensor
        Shape ``(delta.numel(),)``: a coalesced sparse COO tensor, or (fallback) a dense one.
        :func:`densify` with the original shape inverts it; the error of each entry is below
        ``threshold`` (0 for the dense fallback).
    """
    flat = delta.detach().reshape(-1)
    keep = keep_mask(flat, threshold)
    nnz = int(keep.sum())
    if dense_fallback and sparse_nbytes(nnz, flat.element_size()) >= flat.numel() * flat.element_size():
        return flat if owned else flat.clone()
    idx = keep.nonzero().reshape(1, -1)
    return torch.sparse_coo_tensor(idx, flat[keep], (flat.numel(),), is_coalesced=True, check_invariants=False)


def densify(t: torch.Tensor, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
    """The dense tensor of a :func:`sparsify` result (sparse or dense), reshaped to ``shape``."""
    dense = t.to_dense() if t.is_sparse else t
    return dense.reshape(shape) if shape is not None else dense


def hard_threshold(t: torch.Tensor, threshold: float) -> torch.Tensor:
    """``t`` with every entry of ``|t| < threshold`` set to 0 (a new tensor)."""
    return torch.where(t.abs() < threshold, torch.zeros_like(t), t)


def density(t: torch.Tensor) -> float:
    """Fraction of non-zero entries (of the stored values, for a sparse tensor); 0 for an empty tensor."""
    n = t.numel()
    if n == 0:
        return 0.0
    if t.is_sparse:
        t = t.coalesce()
        return int((t.values() != 0).sum()) / n
    return int((t != 0).sum()) / n


def num_values(t: torch.Tensor) -> int:
    """Values a tensor puts on the wire: its non-zeros when sparse, every element when dense."""
    return int(t.coalesce().values().numel()) if t.is_sparse else t.numel()


def nbytes(t: torch.Tensor) -> int:
    """Wire bytes of a tensor: dense elements, or COO values plus indices."""
    if t.is_sparse:
        t = t.coalesce()
        return t.values().numel() * t.values().element_size() + t.indices().numel() * t.indices().element_size()
    return t.numel() * t.element_size()
