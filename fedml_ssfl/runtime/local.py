"""The in-process simulator: the embedded default runtime for one machine.

One process, CPU or one GPU, the K clients simulated in turn. Per round: the seeded sampler
picks C_k clients, the algorithm's server step runs, messages go out, each chosen client
updates from its message, its own data and its persistent state, the replies are aggregated,
and the runtime counts bytes both ways, evaluates every ``frequency_of_the_test`` rounds,
logs (metrics.jsonl, TensorBoard), and checkpoints atomically every ``checkpoint_every``
rounds. ``resume=True`` continues a stopped run and ends with exactly the model an
uninterrupted run ends with (all randomness derives from (seed, round, party)).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..algorithms.base import ClientContext, Message, NonFiniteLossError, message_nbytes
from ..checkpoint import load_checkpoint, save_checkpoint
from ..config import ExperimentConfig, save_config
from ..data import ImageDataset
from ..experiment import Experiment, build_experiment
from ..metrics import evaluate
from ..sampling import sample_clients
from ..tracking import RunTracker
from ..training import cosine_lr

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "last.pt"


@dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    run_dir: Path
    algorithm: str
    final_acc: float
    best_acc: float
    rounds_completed: int
    summary: dict[str, Any] = field(default_factory=dict)


class RunFailed(RuntimeError):
    """A run stopped on an error; the message says where, and what was kept."""


def fresh_run_dir(base: Path) -> Path:
    """``base`` if free, else ``base-2``, ``base-3``, ...: a new run never overwrites an old one."""
    if not base.exists() or not any(base.iterdir()):
        return base
    n = 2
    while (base.parent / f"{base.name}-{n}").exists():
        n += 1
    return base.parent / f"{base.name}-{n}"


def mean_client_metrics(replies: dict[int, Message]) -> dict[str, float]:
    """Average the clients' diagnostic metrics (``extras["metrics"]``) key by key."""
    sums: dict[str, list[float]] = {}
    for msg in replies.values():
        for k, v in msg.extras.get("metrics", {}).items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                sums.setdefault(k, []).append(float(v))
    return {f"client_{k}": sum(v) / len(v) for k, v in sums.items()}


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
        unless resuming).
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
    base = Path(run_dir) if run_dir is not None else cfg.run_dir()
    run_dir = base if resume else fresh_run_dir(base)
    ckpt_path = run_dir / "checkpoints" / CHECKPOINT_NAME
    state = load_checkpoint(ckpt_path, cfg.fingerprint()) if resume else None

    exp = build_experiment(cfg, dataset)
    algo = exp.algorithm
    algo.setup()
    K = cfg.train_args.client_num_in_total
    client_states: dict[int, dict] = {k: {} for k in range(K)}
    start, totals = 0, {"bytes_up": 0, "bytes_down": 0, "seconds": 0.0}
    if state is not None:
        algo.load_state_dict(state["algorithm"])
        client_states = state["client_states"]
        start = state["round"] + 1
        totals = state["totals"]
        log.info("resuming %s after round %d", run_dir, state["round"])
    save_config(cfg, run_dir / "config.yaml")
    tracker = RunTracker(
        run_dir, cfg.tracking_args.enable_tensorboard, resume_round=start - 1 if resume else None
    )
    measured_r = exp.split.measured_r(exp.dataset.train_labels)

    rounds = cfg.train_args.comm_round
    end = rounds if stop_after is None else min(rounds, stop_after)
    best = max((r["test_acc"] for r in tracker.rows if r.get("test_acc") is not None), default=float("nan"))
    last_acc = next(
        (r["test_acc"] for r in reversed(tracker.rows) if r.get("test_acc") is not None), float("nan")
    )
    bar = tqdm(
        range(start, end),
        total=rounds,
        initial=start,
        desc=cfg.algorithm,
        unit="round",
        disable=not cfg.tracking_args.progress_bar,
        dynamic_ncols=True,
        leave=True,
    )
    status = "completed" if end == rounds else "stopped"
    try:
        for r in bar:
            row = run_round(exp, r, client_states)
            totals["bytes_up"] += row["bytes_up"]
            totals["bytes_down"] += row["bytes_down"]
            totals["seconds"] += row["seconds"]
            last = r == rounds - 1
            if last:
                algo.finalize()
            if (r + 1) % cfg.validation_args.frequency_of_the_test == 0 or last or r == end - 1:
                ev = evaluate(
                    algo.global_model(),
                    exp.dataset.test_images,
                    exp.dataset.test_labels,
                    exp.data_info,
                    exp.device,
                    cfg.validation_args.eval_batch_size,
                )
                row["test_acc"], row["test_loss"] = ev["acc"], ev["loss"]
                last_acc = ev["acc"]
                best = ev["acc"] if math.isnan(best) else max(best, ev["acc"])
                bar.set_postfix(acc=f"{100 * ev['acc']:.2f}%")
            tracker.log_round(row)
            if (r + 1) % cfg.tracking_args.checkpoint_every == 0 or last or r == end - 1:
                save_checkpoint(
                    ckpt_path,
                    {
                        "round": r,
                        "fingerprint": cfg.fingerprint(),
                        "algorithm_name": cfg.algorithm,
                        "algorithm": algo.state_dict(),
                        "client_states": client_states,
                        "totals": totals,
                    },
                )
    except NonFiniteLossError as exc:
        status = "failed"
        tracker.write_summary({"status": status, "error": str(exc), "run_dir": str(run_dir)})
        raise RunFailed(
            f"{exc} Last good checkpoint: {ckpt_path if ckpt_path.exists() else 'none yet'}"
        ) from exc
    finally:
        bar.close()
        tracker.close()

    done = len(tracker.rows)
    summary = {
        "status": status,
        "algorithm": cfg.algorithm,
        "dataset": cfg.data_args.dataset,
        "model": f"{cfg.model_args.model}-{cfg.model_args.norm}",
        "rounds_completed": done,
        "comm_round": rounds,
        "final_test_acc": last_acc,
        "best_test_acc": best,
        "bytes_up_total": totals["bytes_up"],
        "bytes_down_total": totals["bytes_down"],
        "bytes_up_per_round": totals["bytes_up"] / max(done, 1),
        "bytes_down_per_round": totals["bytes_down"] / max(done, 1),
        "seconds_total": totals["seconds"],
        "seconds_per_round": totals["seconds"] / max(done, 1),
        "measured_non_iid_r": measured_r,
        "config_fingerprint": cfg.fingerprint(),
        "run_dir": str(run_dir),
    }
    if tracker.rows:
        tracker.plot()
    tracker.write_summary(summary)
    return RunResult(
        run_dir=run_dir,
        algorithm=cfg.algorithm,
        final_acc=last_acc,
        best_acc=best,
        rounds_completed=done,
        summary=summary,
    )


def run_round(exp: Experiment, r: int, client_states: dict[int, dict]) -> dict[str, Any]:
    """One federated round; returns its metrics row (without test accuracy)."""
    cfg, algo = exp.config, exp.algorithm
    t0 = time.perf_counter()
    chosen = sample_clients(
        cfg.common_args.random_seed,
        r,
        cfg.train_args.client_num_in_total,
        cfg.train_args.client_num_per_round,
    )
    algo.server_step(r)
    ctx = ClientContext(round_idx=r, device=exp.device, seed=cfg.common_args.random_seed)
    down = up = 0
    replies: dict[int, Message] = {}
    for k in chosen:
        msg = algo.message_for(k, r)
        down += message_nbytes(msg)
        reply = algo.client_update(msg, exp.client_data(k), client_states[k], ctx)
        up += message_nbytes(reply)
        replies[k] = reply
    metrics = algo.aggregate(replies, r)
    train = algo.train
    return {
        "round": r,
        "clients": len(chosen),
        "bytes_up": up,
        "bytes_down": down,
        "lr": cosine_lr(train, r * train.local_steps),
        **mean_client_metrics(replies),
        **metrics,
        "seconds": time.perf_counter() - t0,
    }
