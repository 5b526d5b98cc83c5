"""Issue 15, the per-parameter work of a round: each cheaper path gives the former one's result bit for bit.

Every reference below is the code as it was before the change (fresh float64 tensors per state and
tensor, the four-operation sparse mask, a copy per dense delta), kept here to compare against. And
the messages a round's clients share are never written to by a client.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedml_ssfl import seeding
from fedml_ssfl.aggregation import Scratch, dense_layout, weight_diversity, weighted_average
from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedsiam import fsm, layer_groups
from fedml_ssfl.algorithms.semifl import server_momentum_step
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime.common import finish_round, start_round
from fedml_ssfl.sparse import densify, keep_mask, sparsify


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (``torch.equal`` calls -0.0 and 0.0 equal; this does not)."""
    as_int = {torch.float64: torch.int64, torch.float32: torch.int32}.get(t.dtype)
    return t.contiguous().view(as_int) if as_int is not None else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(bits(a), bits(b))


def make_states(n: int, channels_last: bool = False, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` model-like states of very different magnitudes (so a changed summation order shows)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        conv = torch.randn(64, 32, 3, 3, generator=g) * 10.0 ** (3 * i - 3)  # large enough for vectorised sums
        if channels_last:
            conv = conv.contiguous(memory_format=torch.channels_last)
        conv[0, 0, 0, :2] = -0.0
        out.append(
            {
                "conv.weight": conv,
                "conv.bias": torch.randn(64, generator=g) * 10.0 ** (2 - i),
                "fc.weight": torch.randn(10, 333, generator=g) * 10.0 ** (i - 1),
                "fc.bias": torch.randn(10, generator=g),
                "bn.num_batches_tracked": torch.tensor(3 + i),
            }
        )
    return out


# ---- the former code ---------------------------------------------------------------------------------------
def old_weight_diversity(before, after, keys=None):
    keys = [k for k in (keys or before.keys()) if before[k].is_floating_point()]
    num = 0.0
    total = {}
    for w in after:
        for k in keys:
            g = w[k].to(torch.float64) - before[k].to(torch.float64)
            num += float((g * g).sum())
            total[k] = total[k] + g if k in total else g
    den = sum(float((t * t).sum()) for t in total.values())
    return num / den if den > 0 else float("nan")


def old_weighted_average(states, weights):
    total = float(sum(weights))
    out = {}
    for k, ref in states[0].items():
        if ref.is_floating_point():
            acc = torch.zeros_like(ref, dtype=torch.float64)
            term = torch.empty_like(acc)
            for s, w in zip(states, weights):
                acc.add_(term.copy_(s[k]).mul_(w / total))
            out[k] = acc.to(ref.dtype)
        else:
            out[k] = torch.stack([s[k] for s in states]).amax(dim=0)
    return out


def old_fsm(target, online, groups):
    out = torch.zeros(len(groups), dtype=torch.float64)
    for j, keys in enumerate(groups.values()):
        num = den = 0.0
        for k in keys:
            s = online[k]
            if not s.is_floating_point():
                continue
            s = s.detach().to(torch.float64)
            d = target[k].detach().to(torch.float64) - s
            num += float((d * d).sum())
            den += float((s * s).sum())
        out[j] = math.sqrt(num) / max(math.sqrt(den), 1e-12) if num > 0 else 0.0
    return out


def old_server_momentum_step(global_state, avg_state, buffer, lr, momentum, param_keys):
    new_state, new_buf = {}, {}
    for k, w in global_state.items():
        if k in param_keys and w.is_floating_point():
            g = w.double() - avg_state[k].double()
            buf = g if k not in buffer else momentum * buffer[k].double() + g
            new_buf[k] = buf.to(w.dtype)
            new_state[k] = (w.double() - lr * buf).to(w.dtype)
        else:
            new_state[k] = avg_state[k].clone()
    return new_state, new_buf


def old_keep_mask(delta, threshold):
    return ~(delta.abs() < threshold) & (delta != 0)


# ---- the reused float64 buffers ----------------------------------------------------------------------------
def test_scratch_views_take_the_tensors_strides_and_only_dense_layouts_qualify():
    nhwc = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    scratch = Scratch.for_tensors([nhwc, torch.randn(7)], 2)
    view = scratch.like(1, nhwc)
    assert view.shape == nhwc.shape and view.stride() == nhwc.stride() and view.dtype == torch.float64
    assert view.data_ptr() == scratch.buffers[1].data_ptr()
    assert dense_layout([nhwc, nhwc.clone()]) and dense_layout([torch.randn(3, 4)])
    assert not dense_layout([nhwc, nhwc.contiguous()])  # mixed layouts take the formula's fresh tensors
    assert not dense_layout([torch.randn(4, 6)[:, ::2]])


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "mixed"])
def test_weight_diversity_is_the_former_formula_bit_for_bit(layout):
    states = make_states(4, channels_last=layout == "channels_last")
    if layout == "mixed":
        states[2]["conv.weight"] = states[2]["conv.weight"].contiguous(memory_format=torch.channels_last)
    before, after = states[0], states[1:]
    for keys in (None, ["fc.weight", "fc.bias"], ["conv.weight"]):
        assert weight_diversity(before, after, keys) == old_weight_diversity(before, after, keys)
    assert math.isnan(weight_diversity(before, []))
    assert math.isnan(weight_diversity(before, [before, before]))


@pytest.mark.parametrize("channels_last", [False, True])
def test_weighted_average_in_reused_buffers_is_the_former_code_bit_for_bit(channels_last):
    states = make_states(3, channels_last=channels_last)
    weights = [1.0, 2.5, 0.3]
    new, old = weighted_average(states, weights), old_weighted_average(states, weights)
    for k in old:
        assert same_bits(new[k], old[k]) if old[k].is_floating_point() else torch.equal(new[k], old[k]), k
    # every result is a tensor of its own, not a view of a reused buffer
    ptrs = [t.untyped_storage().data_ptr() for t in new.values()]
    assert len(set(ptrs)) == len(ptrs)


@pytest.mark.parametrize("channels_last", [False, True])
def test_fsm_is_the_former_formula_bit_for_bit(channels_last):
    online, target = make_states(2, channels_last=channels_last)
    groups = layer_groups(online)
    assert torch.equal(bits(fsm(target, online, groups)), bits(old_fsm(target, online, groups)))


@pytest.mark.parametrize("channels_last", [False, True])
def test_server_momentum_step_is_the_former_formula_bit_for_bit(channels_last):
    glob, avg, buf = make_states(3, channels_last=channels_last)
    keys = {"conv.weight", "conv.bias", "fc.weight"}  # fc.bias: not a parameter here, taken from avg
    inputs = [{k: v.clone() for k, v in s.items()} for s in (glob, avg, buf)]
    for buffer in ({}, {k: buf[k] for k in keys}):
        new = server_momentum_step(glob, avg, buffer, 0.7, 0.9, keys)
        old = old_server_momentum_step(glob, avg, buffer, 0.7, 0.9, keys)
        for got, want in zip(new, old):
            assert got.keys() == want.keys()
            for k in want:
                assert same_bits(got[k], want[k]) if want[k].is_floating_point() else torch.equal(got[k], want[k])
    for before, after in zip(inputs, (glob, avg, buf)):  # the inputs are not modified
        assert all(same_bits(before[k], after[k]) for k in before if before[k].is_floating_point())


def test_float64_results_are_not_views_of_the_reused_buffers():
    """A float64 tensor's ``.to(float64)`` is itself: the results must still be copies, or the next
    tensor's use of the same scratch buffer overwrites them (and SemiFL's ``g.mul_(lr)`` scales them)."""
    a = {"x": torch.tensor([1.0, 2.0], dtype=torch.float64), "y": torch.tensor([10.0, 20.0], dtype=torch.float64)}
    b = {"x": torch.tensor([3.0, 4.0], dtype=torch.float64), "y": torch.tensor([30.0, 40.0], dtype=torch.float64)}
    avg = weighted_average([a, b], [1.0, 1.0])
    assert avg["x"].tolist() == [2.0, 3.0] and avg["y"].tolist() == [20.0, 30.0]
    keys = {"x", "y"}
    for buffer in ({}, {k: torch.ones(2, dtype=torch.float64) for k in keys}):
        new_state, new_buf = server_momentum_step(a, b, buffer, 0.5, 0.9, keys)
        for k in keys:
            g = a[k] - b[k]
            want_buf = g if not buffer else 0.9 * buffer[k] + g
            assert torch.equal(new_buf[k], want_buf), (k, new_buf[k], want_buf)
            assert torch.equal(new_state[k], a[k] - 0.5 * want_buf), k


# ---- sparse deltas -----------------------------------------------------------------------------------------
def test_keep_mask_is_the_former_mask_for_every_threshold_and_special_value():
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(200, generator=g) * 1e-4
    delta[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-5])
    for thr in (0.0, 1e-5, 5e-5, 1.0, -1.0, float("nan"), float("inf")):
        assert torch.equal(keep_mask(delta, thr), old_keep_mask(delta, thr)), thr


def test_an_owned_dense_delta_is_sent_as_is_and_a_borrowed_one_is_copied():
    delta = torch.randn(4, 5)
    borrowed, owned = sparsify(delta, 0.0), sparsify(delta, 0.0, owned=True)
    assert torch.equal(borrowed, owned) and not borrowed.is_sparse
    assert owned.data_ptr() == delta.data_ptr()  # no copy of a temporary
    assert borrowed.data_ptr() != delta.data_ptr()  # the caller's tensor is never shared
    sparse = torch.zeros(4, 5)
    sparse[1, 2] = 3.0
    enc = sparsify(sparse, 1e-5, owned=True)  # a sparse encoding copies its values either way
    assert enc.is_sparse and torch.equal(densify(enc, (4, 5)), sparse)


# ---- shared, read-only messages ----------------------------------------------------------------------------
EXTRA = {
    "semifl": ["ssfl_args.threshold=0.0"],  # an untrained model is never 0.95-sure: its clients would not train
    "fedseal": ["data_args.num_server_val=20"],
}


@pytest.mark.parametrize("algorithm", ["fedavg_ssl", "fedmatch", "fedsiam", "semifl", "fedseal"])
def test_clients_never_write_to_the_messages_they_share(small_config, algorithm):
    """A message's tensors are the server's own (the round's clients share one copy): a client must
    leave them as they came, and the server's state must not change under the clients' updates."""
    cfg = small_config(
        f"ssfl_args.algorithm={algorithm}",
        "train_args.client_num_in_total=2",
        "train_args.client_num_per_round=2",
        "train_args.local_steps=1",
        "train_args.batch_size=8",
        *EXTRA.get(algorithm, []),
    )
    exp = build_experiment(cfg)
    algo = exp.algorithm
    algo.setup()
    states: dict[int, dict] = {0: {}, 1: {}}
    for r in range(2):  # round 2: FedMatch's messages are deltas against the records of round 1
        start = start_round(exp, r)
        sent = {k: {n: t.clone() for n, t in m.weights.items()} for k, m in start.messages.items()}
        server = {n: t.clone() for n, t in algo.state_dict().get("global_state", {}).items()}
        ctx = ClientContext(round_idx=r, device=exp.device, seed=cfg.common_args.random_seed)
        replies = {}
        for k in start.chosen:
            with seeding.global_stream(ctx.seed, "client", r, k, device=exp.device):
                replies[k] = algo.client_update(start.messages[k], exp.client_data(k, r), states[k], ctx)
        for k, m in start.messages.items():
            for n, t in m.weights.items():
                a, b = (x.to_dense() if x.is_sparse else x for x in (t, sent[k][n]))
                assert torch.equal(bits(a), bits(b)), (algorithm, r, k, n)
        for n, t in algo.state_dict().get("global_state", {}).items():
            if t.is_floating_point():
                assert torch.equal(bits(t), bits(server[n])), (algorithm, r, n)
        finish_round(exp, start, replies, 0)


# ---- the optimiser step's clip and gradient reset (training.py) ---------------------------------
@pytest.mark.parametrize("scale", [1e-4, 0.3, 50.0, float("inf"), float("nan")])
@pytest.mark.parametrize("kind", ["float32", "float64", "mixed"])
def test_clip_grad_norm_is_torchs_bit_for_bit(scale, kind):
    """Gradients below and above the bound, inf and NaN, a parameter without a gradient: the clipped
    gradients equal nn.utils.clip_grad_norm_'s on each path (float32 on the CPU: the coefficient on
    Python floats; float64: the tensor coefficient, as on a GPU; mixed dtypes: torch's function)."""
    from fedml_ssfl.training import clip_grad_norm

    gen = torch.Generator().manual_seed(7)
    shapes = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (10, 64), (10,)]
    dtypes = {"float32": [torch.float32] * 5, "float64": [torch.float64] * 5}.get(
        kind, [torch.float32, torch.float64, torch.float32, torch.float32, torch.float32]
    )
    params = [nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    grads = [
        None if i == 3 else (torch.randn(s, generator=gen) * scale).to(p.dtype)
        for i, (s, p) in enumerate(zip(shapes, params))
    ]
    results = []
    for clip in (lambda ps: nn.utils.clip_grad_norm_(ps, 0.5), lambda ps: clip_grad_norm(ps, 0.5)):
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        clip(params)
        results.append([p.grad for p in params])
    for want, got in zip(*results):
        assert (want is None and got is None) or torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0))
    if scale == 50.0:
        assert not torch.equal(results[1][0], grads[0])  # the bound was hit: the gradients were scaled


def test_clip_coefficient_is_torchs_float32_arithmetic():
    """The CPU clip computes torch's coefficient on Python floats rounded to float32: over norms from
    1e-30 to 1e30 and bounds from 1e-3 to 1e3, the clipped gradients equal clip_grad_norm_'s bit for bit."""
    from fedml_ssfl.training import clip_grad_norm

    gen = torch.Generator().manual_seed(11)
    for trial in range(400):
        scale = 10.0 ** float(torch.empty(()).uniform_(-30, 30, generator=gen))
        max_norm = 10.0 ** float(torch.empty(()).uniform_(-3, 3, generator=gen))
        grads = [torch.randn(s, generator=gen) * scale for s in [(7, 3), (5,), (2, 2, 3)]]
        clipped = []
        for clip in (nn.utils.clip_grad_norm_, clip_grad_norm):
            params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            clip(params, max_norm)
            clipped.append([p.grad.view(torch.int32) for p in params])
        for want, got in zip(*clipped):
            assert torch.equal(want, got), (trial, scale, max_norm)


def test_clear_grads_is_zero_grad_set_to_none():
    from fedml_ssfl.training import clear_grads

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    clear_grads(opt)
    assert all(p.grad is None for p in model.parameters())
