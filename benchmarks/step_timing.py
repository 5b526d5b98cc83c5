"""One SGD training step, timed; and several ways of running it, alternated step by step.

Shared by the ``*_step.py`` benchmarks: forward, cross-entropy, ``zero_grad``, backward, step on a
fixed batch. The ways alternate step by step after a warm-up, so a machine whose load drifts
shifts them alike; each way's figure is its median. The clock is this process's CPU seconds on a
CPU and wall seconds with a CUDA synchronisation on a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

Run = tuple[Callable[[torch.Tensor], torch.Tensor], torch.optim.Optimizer]
"""What computes the logits (a model, or a compiled one) and the optimiser of its parameters."""


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one training step of ``run`` on ``(x, y)``."""
    forward, opt = run
    cuda = x.device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    t0 = clock()
    loss = nn.functional.cross_entropy(forward(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize(x.device)
    return clock() - t0


def alternate(runs: dict[str, Run], x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each run, the runs taking turns for ``warmup + steps`` rounds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name, run in runs.items():
            t = train_step(run, x, y)
            if i >= warmup:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}
