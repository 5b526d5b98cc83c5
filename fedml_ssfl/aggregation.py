"""Model averaging: FedAvg with the server as one model (Eq. 4/5), grouping (Eq. 7), Eq. 8.

All functions take and return state dicts (``dict[str, Tensor]``) on CPU. Floating tensors
are averaged; integer buffers (BatchNorm's ``num_batches_tracked``) take the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

State = dict[str, torch.Tensor]


def weighted_average(states: Sequence[State], weights: Sequence[float] | None = None) -> State:
    """Average state dicts, uniformly or with ``weights`` (normalised to sum to one).

    Raises
    ------
    ValueError
        When ``states`` is empty or the dicts disagree on keys or shapes.
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
    keys = list(states[0].keys())
    for s in states[1:]:
        if list(s.keys()) != keys:
            raise ValueError("weighted_average: state dicts have different keys")
    out: State = {}
    for k in keys:
        ref = states[0][k]
        if ref.is_floating_point():
            acc = torch.zeros_like(ref, dtype=torch.float64)
            for s, w in zip(states, weights):
                if s[k].shape != ref.shape:
                    raise ValueError(
                        f"weighted_average: '{k}' has shape {tuple(s[k].shape)}, not {tuple(ref.shape)}"
                    )
                acc += s[k].to(torch.float64) * (w / total)
            out[k] = acc.to(ref.dtype)
        else:
            out[k] = torch.stack([s[k] for s in states]).amax(dim=0)
    return out


def fedavg_with_server(server: State, clients: Sequence[State]) -> State:
    """Zhang et al. Eq. 4 (all K clients) and Eq. 5 (C_k sampled clients).

    ``w_avg = (w_s + sum_k w_k) / (C_k + 1)``: uniform, the server counting as one model.
    """
    return weighted_average([server, *clients])


def grouping_average(server: State, groups: Sequence[Sequence[State]]) -> tuple[list[State], State]:
    """Zhang et al. Eq. 7: each group averages with the server; the global is their mean.

    ``w_avg,i = (w_s + sum_{k in G_i} w_k) / (|G_i| + 1)`` and ``w_avg = sum_i w_avg,i / S``.
    An empty group is ``w_s`` itself by the same formula.

    Returns
    -------
    (list of State, State)
        The S group averages (group i receives its own next round) and the global model.
    """
    if not groups:
        raise ValueError("grouping_average: at least one group is needed")
    group_avgs = [fedavg_with_server(server, list(g)) for g in groups]
    return group_avgs, weighted_average(group_avgs)


def weight_diversity(before: State, after: Sequence[State], keys: Sequence[str] | None = None) -> float:
    """Weight diversity after Zhang et al. Eq. 8 / Yin et al.'s gradient diversity.

    With ``g_i = w_i - w_before`` for each participating model,
    ``diversity = sum_i ||g_i||^2 / ||sum_i g_i||^2``. It is 1/n when all n updates are equal
    and grows as they disagree. ``keys`` restricts it to some tensors (e.g. the classifier).
    Returns ``nan`` when the updates sum to zero.
    """
    keys = [k for k in (keys or before.keys()) if before[k].is_floating_point()]
    num = 0.0
    total: dict[str, torch.Tensor] = {}
    for w in after:
        for k in keys:
            g = w[k].to(torch.float64) - before[k].to(torch.float64)
            num += float((g * g).sum())
            total[k] = total[k] + g if k in total else g
    den = sum(float((t * t).sum()) for t in total.values())
    return num / den if den > 0 else float("nan")


def check_update(reference: State, update: State) -> str | None:
    """Why an update cannot be averaged (wrong keys, shapes or non-finite values), or ``None``."""
    if set(update) != set(reference):
        missing = sorted(set(reference) - set(update))[:3]
        extra = sorted(set(update) - set(reference))[:3]
        return f"keys differ (missing {missing}, unexpected {extra})"
    for k, ref in reference.items():
        t = update[k]
        if t.shape != ref.shape:
            return f"'{k}' has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
        if t.is_floating_point() and not torch.isfinite(t).all():
            return f"'{k}' has NaN or infinite values"
    return None
