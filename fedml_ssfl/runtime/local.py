"""The in-process simulator: the embedded default runtime for one machine.

One process, CPU or one GPU, the K clients simulated in turn. Per round: the seeded sampler
picks C_k clients, the algorithm's server step runs, messages go out, each chosen client
updates from its message, its own data and its persistent state, the replies are aggregated,
and the runtime counts bytes both ways, evaluates every ``frequency_of_the_test`` rounds,
logs (metrics.jsonl, TensorBoard), and checkpoints atomically every ``checkpoint_every``
rounds. ``resume=True`` continues a stopped run and ends with exactly the model an
uninterrupted run ends with (all randomness derives from (seed, round, party)).

The round halves, evaluation, logging, checkpoints and summary live in :mod:`.common`, shared
with the FedML runtime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from .. import seeding
from ..algorithms.base import ClientContext, Message, NonFiniteLossError, message_nbytes
from ..checkpoint import load_checkpoint
from ..client_state import ClientStateError, close_client_states
from ..config import ExperimentConfig
from ..data import ImageDataset
from ..experiment import Experiment, build_experiment
from ..participation import Planner
from .common import (
    CHECKPOINT_NAME,
    RoundProgress,
    RunFailed,
    RunRecorder,
    RunResult,
    deliver_to_listeners,
    finish_round,
    fresh_run_dir,
    mean_client_metrics,
    run_client_states,
    run_folder,
    start_round,
)

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_NAME",
    "RunFailed",
    "RunResult",
    "fresh_run_dir",
    "mean_client_metrics",
    "run_local",
    "run_round",
]


def run_local(
    cfg: ExperimentConfig,
    run_dir: str | Path | None = None,
    resume: bool = False,
    dataset: ImageDataset | None = None,
    stop_after: int | None = None,
) -> RunResult:
    """Run an experiment in this process.

    Parameters
    ----------
    cfg : ExperimentConfig
        A validated config.
    run_dir : path, optional
        Output folder; default ``output_dir/run_name`` (suffixed ``-2``, ``-3`` ... when taken,
        unless resuming). A new folder is removed again if the run fails before writing into it
        (data, model, device or setup errors).
    resume : bool
        Continue from ``run_dir/checkpoints/last.pt``. A corrupt or mismatched checkpoint is
        refused (and left untouched).
    dataset : ImageDataset, optional
        Reuse an already loaded dataset.
    stop_after : int, optional
        Stop after this many rounds in total (a controlled interruption; resume continues).

    Returns
    -------
    RunResult
    """
    started = time.perf_counter()  # summary.json's wall_seconds count from here
    base = Path(run_dir) if run_dir is not None else cfg.run_dir()
    with run_folder(base, resume) as folder:  # a new folder the run wrote nothing into is removed on an error
        return _run_in(folder, cfg, resume, dataset, stop_after, started)


def _run_in(
    run_dir: Path,
    cfg: ExperimentConfig,
    resume: bool,
    dataset: ImageDataset | None,
    stop_after: int | None,
    started: float,
) -> RunResult:
    """:func:`run_local`'s body, in its claimed (or resumed) ``run_dir``; ``started``: the run's start time."""
    ckpt_path = run_dir / "checkpoints" / CHECKPOINT_NAME
    state = load_checkpoint(ckpt_path, cfg.fingerprint(), cfg.to_dict()) if resume else None

    planner = Planner.from_config(cfg)  # reads an availability trace or a replayed participation.jsonl
    exp = build_experiment(cfg, dataset)
    algo = exp.algorithm
    algo.setup()
    client_states = run_client_states(cfg, run_dir, state)  # a dict, or a store under device_args.state_memory_mb
    if state is not None:
        log.info("resuming %s after round %d", run_dir, state["round"] + 1)
    try:
        rec = RunRecorder(cfg, exp, run_dir, resume_state=state, started=started)
    except BaseException:
        close_client_states(client_states)  # e.g. a damaged server-record file refused the resume
        raise
    start = rec.start

    rounds = cfg.train_args.comm_round
    end = rounds if stop_after is None else min(rounds, stop_after)
    progress = RoundProgress(cfg, start, cfg.algorithm)
    status = "completed" if end == rounds else "stopped"
    try:
        for r in range(start, end):
            # a plain planner is the default sampling: run_round's own (its three-argument call is public)
            row = run_round(exp, r, client_states) if planner.plain else run_round(exp, r, client_states, planner)
            progress.update(rec.record(r, row, end, client_states))
    except (NonFiniteLossError, ClientStateError) as exc:
        raise rec.fail(exc) from exc
    finally:
        progress.close()
        rec.close()
        close_client_states(client_states)
    return rec.result(status, runtime="local")


def run_round(
    exp: Experiment, r: int, client_states: MutableMapping[int, dict], planner: Planner | None = None
) -> dict[str, Any]:
    """One federated round; returns its metrics row (without test accuracy).

    ``planner`` says who takes part (:class:`~fedml_ssfl.participation.Planner`; default: the seeded
    sampler's C_k clients). The clients that answer train one after another, or together
    (``train_args.stack_clients``: :meth:`~fedml_ssfl.algorithms.base.Algorithm.client_updates_stacked`);
    a client that is not reachable this round is left alone, its state untouched.
    """
    cfg, algo = exp.config, exp.algorithm
    start = start_round(exp, r, planner)
    ctx = ClientContext(round_idx=r, device=exp.device, seed=cfg.common_args.random_seed)
    if cfg.train_args.stack_clients and start.chosen:
        work = {k: (start.messages[k], exp.client_data(k, r), client_states[k]) for k in start.chosen}
        with seeding.global_stream(ctx.seed, "client", r, "stacked", device=exp.device):
            replies = algo.run_client_updates_stacked(work, ctx, cfg.train_args.stack_size)
        for k, (_, _, state) in work.items():
            client_states[k] = state  # a bounded store may have spilled it since it was read (client_state.py)
        deliver_to_listeners(exp, start, client_states)
        return finish_round(exp, start, replies, sum(message_nbytes(m) for m in replies.values()))
    up = 0
    replies: dict[int, Message] = {}
    for k in start.chosen:
        with seeding.global_stream(ctx.seed, "client", r, k, device=exp.device):
            reply = algo.run_client_update(start.messages[k], exp.client_data(k, r), client_states[k], ctx)
        up += message_nbytes(reply)
        replies[k] = reply
    deliver_to_listeners(exp, start, client_states)  # the clients not sampled receive the round's model too
    return finish_round(exp, start, replies, up)
