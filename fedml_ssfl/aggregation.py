"""Model averaging: FedAvg with the server as one model (Eq. 4/5), grouping (Eq. 7), Eq. 8.

All functions take and return state dicts (``dict[str, Tensor]``) on CPU. Floating tensors
are averaged; integer buffers (BatchNorm's ``num_batches_tracked``) take the maximum. With
``keys`` only the named tensors are averaged and every other one is copied from the first state
(Zhang et al.'s code averages parameters only, each model keeping its own BatchNorm statistics;
with the server first, the averaged model keeps the server's).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch

State = dict[str, torch.Tensor]


def dense_layout(tensors: Iterable[torch.Tensor]) -> bool:
    """True when the tensors share one shape and one set of strides, contiguous or channels_last.

    For such tensors an element-wise result and a full reduction do not depend on where their
    memory lies: :class:`Scratch` views can stand in for fresh tensors, bit for bit.
    """
    first: torch.Tensor | None = None
    for t in tensors:
        if first is None:
            first = t
            if not (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))):
                return False
        elif t.shape != first.shape or t.stride() != first.stride():
            return False
    return True


class Scratch:
    """Reusable float64 work tensors: ``slots`` flat buffers of ``numel`` elements, viewed per tensor.

    A 10 M-parameter model's float64 temporaries (two or three fresh tensors per state and
    tensor) cost more in allocation and page faults than in arithmetic; views of a few buffers
    sized to the largest tensor do the same arithmetic (issue 15). Results taken from a view
    must be copied out (``.to(dtype)``, ``float(...)``) before the slot is used again.
    """

    def __init__(self, numel: int, slots: int, dtype: torch.dtype = torch.float64) -> None:
        self.buffers = [torch.empty(max(numel, 1), dtype=dtype) for _ in range(slots)]

    @classmethod
    def for_tensors(cls, tensors: Iterable[torch.Tensor], slots: int) -> Scratch:
        """Buffers sized to the largest of ``tensors``."""
        return cls(max((t.numel() for t in tensors), default=1), slots)

    def like(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        """Slot ``slot`` viewed with ``t``'s shape and strides (``t`` must pass :func:`dense_layout`)."""
        return self.buffers[slot][: t.numel()].as_strided(t.shape, t.stride())


def weighted_average(
    states: Sequence[State], weights: Sequence[float] | None = None, *, keys: Collection[str] | None = None
) -> State:
    """Average state dicts, uniformly or with ``weights`` (normalised to sum to one).

    ``keys`` (default: all) are the tensors to average; every other tensor is a copy of
    ``states[0]``'s (e.g. ``keys`` = the parameter names keeps the first model's BatchNorm
    running statistics).

    Raises
    ------
    ValueError
        When ``states`` is empty, the dicts disagree on keys or shapes, or ``keys`` names a
        tensor they lack.
    """
    if not states:
        raise ValueError("weighted_average: nothing to average")
    if weights is None:
        weights = [1.0] * len(states)
    if len(weights) != len(states):
        raise ValueError("weighted_average: one weight per state is needed")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_average: weights must sum to a positive number")
    names = list(states[0].keys())
    for s in states[1:]:
        if list(s.keys()) != names:
            raise ValueError("weighted_average: state dicts have different keys")
    averaged = None if keys is None else set(keys)
    if averaged is not None and not averaged <= set(names):
        raise ValueError(f"weighted_average: keys {sorted(averaged - set(names))[:3]} are not in the state dicts")
    out: State = {}
    scratch: Scratch | None = None
    for k in names:
        ref = states[0][k]
        if averaged is not None and k not in averaged:
            out[k] = ref.clone()
        elif ref.is_floating_point():
            for s in states:
                if s[k].shape != ref.shape:
                    raise ValueError(f"weighted_average: '{k}' has shape {tuple(s[k].shape)}, not {tuple(ref.shape)}")
            # acc += float64(s) * (w / total), in two buffers reused over the states and tensors (a
            # 10 M-parameter model otherwise allocates, and faults in, fresh float64 copies per tensor)
            if dense_layout([ref]):
                if scratch is None:
                    scratch = Scratch.for_tensors((states[0][n] for n in names), 2)
                acc, term = scratch.like(0, ref).zero_(), scratch.like(1, ref)
            else:
                acc = torch.zeros_like(ref, dtype=torch.float64)
                term = torch.empty_like(acc)
            for s, w in zip(states, weights):
                acc.add_(term.copy_(s[k]).mul_(w / total))
            out[k] = acc.to(ref.dtype, copy=True)  # a copy even for float64: acc may be a scratch view
        else:
            out[k] = torch.stack([s[k] for s in states]).amax(dim=0)
    return out


def fedavg_with_server(server: State, clients: Sequence[State], *, keys: Collection[str] | None = None) -> State:
    """Zhang et al. Eq. 4 (all K clients) and Eq. 5 (C_k sampled clients).

    ``w_avg = (w_s + sum_k w_k) / (C_k + 1)``: uniform, the server counting as one model.
    ``keys`` restricts the average to those tensors; the rest are the server's own.
    """
    return weighted_average([server, *clients], keys=keys)


def grouping_average(
    server: State, groups: Sequence[Sequence[State]], *, keys: Collection[str] | None = None
) -> tuple[list[State], State]:
    """Zhang et al. Eq. 7: each group averages with the server; the global is their mean.

    ``w_avg,i = (w_s + sum_{k in G_i} w_k) / (|G_i| + 1)`` and ``w_avg = sum_i w_avg,i / S``.
    An empty group is ``w_s`` itself by the same formula. ``keys`` restricts both averages to
    those tensors; the rest are the server's own in every returned model.

    Returns
    -------
    (list of State, State)
        The S group averages (group i receives its own next round) and the global model.
    """
    if not groups:
        raise ValueError("grouping_average: at least one group is needed")
    group_avgs = [fedavg_with_server(server, list(g), keys=keys) for g in groups]
    return group_avgs, weighted_average(group_avgs, keys=keys)


def weight_diversity(
    before: State, after: Sequence[State], keys: Sequence[str] | None = None, starts: Sequence[State] | None = None
) -> float:
    """Weight diversity after Zhang et al. Eq. 8 / Yin et al.'s gradient diversity.

    With ``g_i = w_i - w_i^start`` for each participating model, where ``w_i^start`` is where party
    i started its round (``starts[i]``; default ``before`` for every party),
    ``diversity = sum_i ||g_i||^2 / ||sum_i g_i||^2``. It is 1/n when all n updates are equal
    and grows as they disagree (the SSFL benchmark authors' plots show n times this, the mean of
    ``||g_i||^2 / ||mean_j g_j||^2``, which is 1 for equal updates). ``keys`` restricts it to some
    tensors (e.g. the classifier); they are taken from ``before``. Returns ``nan`` when the updates
    sum to zero.
    """
    keys = [k for k in (keys or before.keys()) if before[k].is_floating_point()]
    if starts is not None and len(starts) != len(after):
        raise ValueError(f"weight_diversity: {len(starts)} starts for {len(after)} models")
    origin = list(starts) if starts is not None else [before] * len(after)
    # Tensor by tensor over the models, in four reused float64 buffers (a fresh g, g * g and running
    # sum per model and tensor cost a 10 M-parameter model more than the arithmetic; issue 15). The
    # squared norms are added up in the definition's order, models outer, so the result is the same.
    squares = [[0.0] * len(keys) for _ in after]  # ||g_i[k]||^2
    sums: list[float] = []  # ||sum_i g_i[k]||^2
    scratch = Scratch.for_tensors((before[k] for k in keys), 4) if after else None
    for j, k in enumerate(keys):
        if not after:
            break
        ref = before[k]
        refs = [o[k] for o in origin]
        if scratch is not None and dense_layout([ref, *refs, *(w[k] for w in after)]):
            base, g, sq, total = (scratch.like(slot, ref) for slot in range(4))
            for i, w in enumerate(after):
                base.copy_(refs[i])
                g.copy_(w[k]).sub_(base)
                squares[i][j] = float(torch.mul(g, g, out=sq).sum())
                total.copy_(g) if i == 0 else total.add_(g)
            sums.append(float(torch.mul(total, total, out=sq).sum()))
        else:  # mixed layouts: fresh tensors, as the formula reads
            acc = None
            for i, w in enumerate(after):
                d = w[k].to(torch.float64) - refs[i].to(torch.float64)
                squares[i][j] = float((d * d).sum())
                acc = d if acc is None else acc + d
            sums.append(float((acc * acc).sum()))
    num = 0.0
    for row in squares:
        for v in row:
            num += v
    den = sum(sums)
    return num / den if den > 0 else float("nan")
