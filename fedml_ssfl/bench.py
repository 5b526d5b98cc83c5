"""Round speed: a federated round against a plain PyTorch loop of the same passes (issue 15).

:func:`measure_round_speed` runs a config's rounds in this process (the local runtime's
:func:`~fedml_ssfl.runtime.local.run_round` and the run recorder's evaluation, logging and
checkpoints, exactly as ``fedml-ssfl run`` does) and, after each round, a *reference*: the same
model doing the same passes in a plain PyTorch loop on already-augmented tensors. The passes are
counted, not estimated: while a round runs, a forward hook on the model's class records every
forward call (input shape, with or without gradient, train or eval mode) and an optimiser hook
every optimiser step (one backward each); :func:`replay` repeats that sequence with one model and
one SGD (same momentum, Nesterov and weight decay), cross-entropy on the logits of the forwards
since the last step. Round and reference alternate (round, reference, round, reference, ...) and
the figures are medians over the measured rounds, so a machine whose load drifts shifts both
alike: ``ratio = round seconds / reference seconds`` is the federated overhead (augmentation, data
indexing, messages, aggregation, evaluation's data pipeline, logging, checkpoints, Python).

Reference variants (``+``-joined flags, e.g. ``channels_last+inference``): ``eager`` (the model and
the inputs' memory layout as the round has them), ``contiguous`` (model and inputs in NCHW),
``channels_last`` (model and inputs in NHWC), ``inference`` (no-gradient passes under
:func:`torch.inference_mode`), ``compile`` (:func:`torch.compile`; the first replay, which compiles,
is reported apart as ``compile_seconds``). The headline ``ratio_best`` divides by the fastest
variant of each round: the reference is the plain loop as fast as these variants make it. Each
round's breakdown (forward, backward, optimiser step, augmentation, recording) comes from timers on
the same hooks.

:func:`first_round_seconds` measures the time from starting ``fedml-ssfl run`` to the start of
its first round, in a fresh interpreter, and which heavy packages were imported by then.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .client_state import close_client_states
from .config import ConfigError, ExperimentConfig
from .experiment import build_experiment, model_factory
from .models.layout import apply_layout, model_layout
from .models.precision import apply_precision
from .runtime.common import RunRecorder, run_client_states
from .runtime.local import run_round
from .training import InputPipeline, clear_grads

log = logging.getLogger(__name__)

VARIANT_FLAGS = ("eager", "contiguous", "channels_last", "inference", "compile")
"""The flags a reference variant is made of (``eager`` alone: the model as the round builds it)."""

DEFAULT_VARIANTS = ("contiguous+inference", "channels_last+inference")

HEAVY_MODULES = (
    "onnx",
    "onnxruntime",
    "fedml",
    "mpi4py",
    "matplotlib",
    "tensorboard",
    "torchvision",
    "sklearn",
    "scipy",
    "pandas",
    "mlxtend",
)
"""Packages whose import the run path should not pay before it needs them (each costs 0.3 to 2 s)."""


# ---------------------------------------------------------------------------------------------
# what a round does, counted


@dataclass(frozen=True)
class Forward:
    """One forward call of the model: input shape, whether a backward runs through it, mode."""

    shape: tuple[int, ...]
    grad: bool
    training: bool
    classes: int


@dataclass(frozen=True)
class OptimizerStep:
    """One optimiser step (after one backward through the forwards with gradient since the last)."""

    momentum: float
    nesterov: bool
    weight_decay: float


Event = Forward | OptimizerStep


@dataclass
class Workload:
    """The passes of one round, in order."""

    events: list[Event]

    @property
    def forwards(self) -> list[Forward]:
        return [e for e in self.events if isinstance(e, Forward)]

    def summary(self) -> dict[str, int]:
        """Counts: forwards with and without gradient, optimiser steps, images through each kind of forward."""
        fw = self.forwards
        return {
            "forwards_grad": sum(f.grad for f in fw),
            "forwards_nograd": sum(not f.grad for f in fw),
            "optimizer_steps": sum(isinstance(e, OptimizerStep) for e in self.events),
            "images_grad": sum(f.shape[0] for f in fw if f.grad),
            "images_nograd": sum(f.shape[0] for f in fw if not f.grad),
        }


class PassRecorder:
    """Counts and times, while active, the passes of every model of class ``model_type``.

    Global module hooks see every instance (models an algorithm builds lazily, copies, helpers run
    through :func:`torch.func.functional_call`); only calls of ``model_type`` itself are recorded.
    Timers (seconds of ``clock``, by default this process's CPU time): ``forward`` (those calls),
    ``backward`` (:meth:`torch.Tensor.backward`), ``optimizer`` (optimiser steps), ``augment`` (the
    input pipeline's weak and strong views), ``inputs`` (its plain view).
    """

    def __init__(self, model_type: type[nn.Module], clock: Any = time.process_time) -> None:
        self.model_type = model_type
        self.clock = clock
        self.events: list[Event] = []
        self.timers = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "augment": 0.0, "inputs": 0.0}
        self._handles: list[Any] = []
        self._saved: dict[str, Any] = {}
        self._starts: list[float] = []
        self._opt_start = 0.0

    def __enter__(self) -> PassRecorder:
        from torch.nn.modules import module as module_hooks
        from torch.optim import optimizer as optimizer_hooks

        def pre(mod: nn.Module, args: Any) -> None:
            if type(mod) is self.model_type:
                self._starts.append(self.clock())

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            if type(mod) is not self.model_type:
                return
            self.timers["forward"] += self.clock() - self._starts.pop()
            x = args[0] if args else None
            logits = out if isinstance(out, torch.Tensor) else None
            if isinstance(x, torch.Tensor) and logits is not None:
                classes = int(logits.shape[-1]) if logits.dim() else 1
                self.events.append(Forward(tuple(x.shape), bool(logits.requires_grad), bool(mod.training), classes))

        def opt_pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._opt_start = self.clock()

        def opt_post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.timers["optimizer"] += self.clock() - self._opt_start
            g = opt.param_groups[0]
            self.events.append(
                OptimizerStep(
                    float(g.get("momentum", 0.0)), bool(g.get("nesterov", False)), float(g.get("weight_decay", 0.0))
                )
            )

        self._handles = [
            module_hooks.register_module_forward_pre_hook(pre),
            module_hooks.register_module_forward_hook(post),
            optimizer_hooks.register_optimizer_step_pre_hook(opt_pre),
            optimizer_hooks.register_optimizer_step_post_hook(opt_post),
        ]
        self._saved = {
            "backward": torch.Tensor.backward,
            "weak": InputPipeline.weak,
            "strong": InputPipeline.strong,
            "plain": InputPipeline.plain,
        }
        torch.Tensor.backward = self._timed(self._saved["backward"], "backward")  # type: ignore[method-assign]
        InputPipeline.weak = self._timed(self._saved["weak"], "augment")  # type: ignore[method-assign]
        InputPipeline.strong = self._timed(self._saved["strong"], "augment")  # type: ignore[method-assign]
        InputPipeline.plain = self._timed(self._saved["plain"], "inputs")  # type: ignore[method-assign]
        return self

    def _timed(self, fn: Any, name: str) -> Any:
        timers, clock = self.timers, self.clock

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += clock() - t0

        return wrapper

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        torch.Tensor.backward = self._saved["backward"]  # type: ignore[method-assign]
        InputPipeline.weak = self._saved["weak"]  # type: ignore[method-assign]
        InputPipeline.strong = self._saved["strong"]  # type: ignore[method-assign]
        InputPipeline.plain = self._saved["plain"]  # type: ignore[method-assign]

    @property
    def workload(self) -> Workload:
        return Workload(list(self.events))


# ---------------------------------------------------------------------------------------------
# the reference: the same passes in a plain loop


def parse_variant(name: str) -> frozenset[str]:
    """The flags of a reference variant name such as ``channels_last+inference``.

    Raises
    ------
    ConfigError
        An unknown flag (the message lists the known ones).
    """
    flags = frozenset(f.strip() for f in name.split("+") if f.strip())
    unknown = sorted(flags - set(VARIANT_FLAGS))
    if unknown or not flags or {"contiguous", "channels_last"} <= flags:
        raise ConfigError(
            f"--variants: unknown reference variant {name!r}; combine {', '.join(VARIANT_FLAGS)} with '+' "
            "(one memory layout at most)"
        )
    return flags - {"eager"}


def reference_inputs(
    shapes: Sequence[tuple[int, ...]],
    images: torch.Tensor,
    pipeline: InputPipeline,
    generator: torch.Generator,
    layout: torch.memory_format | None = None,
) -> dict[tuple[int, ...], torch.Tensor]:
    """One already-augmented, normalised input per shape: weak views of ``images`` (cycled to the size).

    A shape whose image dimensions are not the dataset's gets standard-normal noise instead. ``layout``
    (a memory format) rewrites the inputs' strides; None keeps what the input pipeline gives.
    """
    out: dict[tuple[int, ...], torch.Tensor] = {}
    for shape in sorted(set(shapes)):
        if tuple(shape[1:]) == tuple(images.shape[1:]):
            idx = torch.arange(shape[0]) % images.shape[0]
            x = pipeline.weak(images[idx], generator)
        else:
            x = torch.randn(shape, generator=generator).to(pipeline.device)
        if layout is not None and x.dim() == 4:
            x = x.clone(memory_format=layout)
        out[shape] = x
    return out


def replay(
    workload: Workload,
    model: nn.Module,
    inputs: dict[tuple[int, ...], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    inference: bool = False,
) -> tuple[float, float]:
    """Run ``workload``'s passes with ``model`` and ``optimizer``; returns (wall, CPU) seconds taken.

    Each :class:`Forward` runs ``model`` on ``inputs[shape]`` in the recorded mode (under
    ``no_grad``, or ``inference_mode`` with ``inference``, when it had no gradient); each
    :class:`OptimizerStep` clears the gradients (:func:`~fedml_ssfl.training.clear_grads`, as the
    round's steps do), takes one backward of the summed cross-entropy of the forwards with gradient
    since the last step, and ``step``.
    """
    labels: dict[tuple[int, int, str], torch.Tensor] = {}
    device = next(model.parameters()).device
    no_grad = torch.inference_mode if inference else torch.no_grad
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for ev in workload.events:
        if isinstance(ev, Forward):
            model.train(ev.training)
            x = inputs[ev.shape]
            if ev.grad:
                key = (ev.shape[0], ev.classes, str(device))
                if key not in labels:
                    labels[key] = torch.arange(ev.shape[0], device=device) % ev.classes
                pending.append((model(x), labels[key]))
            else:
                with no_grad():
                    model(x)
        elif pending:
            loss = sum(F.cross_entropy(out, y) for out, y in pending)
            clear_grads(optimizer)  # as the round clears them
            loss.backward()
            optimizer.step()
            pending = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


class Reference:
    """A reference variant: its model, optimiser and inputs, built once and replayed every round.

    ``model`` is a freshly built model (no layout applied); ``round_layout`` is the round's
    ``device_args.memory_format``, which the ``eager`` variant keeps; ``autocast`` is the round's
    ``device_args.autocast``, which every variant keeps (the reference computes in the round's precision).
    """

    def __init__(
        self, name: str, model: nn.Module, device: torch.device, round_layout: str = "unchanged", autocast: str = "off"
    ) -> None:
        self.name = name
        self.flags = parse_variant(name)
        choice = next((f for f in ("channels_last", "contiguous") if f in self.flags), round_layout)
        self.model = apply_precision(apply_layout(model, choice, device.type), autocast).to(device)
        self.layout = model_layout(self.model)  # the inputs are made in it: the model's pre-hook has nothing to do
        self.runner: nn.Module = self.model
        if "compile" in self.flags:
            self.runner = torch.compile(self.model)  # type: ignore[assignment]
        self.optimizer: torch.optim.Optimizer | None = None
        self.inputs: dict[tuple[int, ...], torch.Tensor] = {}
        self.compile_seconds: float | None = None

    def run(
        self, workload: Workload, images: torch.Tensor, pipeline: InputPipeline, gen: torch.Generator
    ) -> tuple[float, float]:
        """Replay ``workload`` (inputs for new shapes are made first, not timed); (wall, CPU) seconds."""
        missing = [f.shape for f in workload.forwards if f.shape not in self.inputs]
        self.inputs.update(reference_inputs(missing, images, pipeline, gen, self.layout))
        if self.optimizer is None:
            step = next((e for e in workload.events if isinstance(e, OptimizerStep)), OptimizerStep(0.9, False, 0.0))
            self.optimizer = torch.optim.SGD(
                self.model.parameters(),
                lr=1e-3,
                momentum=step.momentum,
                nesterov=step.nesterov and step.momentum > 0,
                weight_decay=step.weight_decay,
            )
        return replay(workload, self.runner, self.inputs, self.optimizer, inference="inference" in self.flags)


# ---------------------------------------------------------------------------------------------
# the measurement


def machine_info(threads: int) -> dict[str, Any]:
    """Where and how the figures were taken: CPU, cores, torch and its threads, load average, date."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": threads,
        "loadavg": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


@contextmanager
def _profiled(enabled: bool, top: int, out: dict[str, Any]) -> Iterator[None]:
    if not enabled:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        out["profile"] = text.getvalue()


def measure_round_speed(
    cfg: ExperimentConfig,
    rounds: int = 3,
    warmup: int = 1,
    threads: int = 1,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    reference_repeats: int = 1,
    profile: bool = False,
    profile_top: int = 30,
) -> dict[str, Any]:
    """Seconds per round of ``cfg`` and of its reference, side by side in this process.

    Round and reference are timed twice: wall seconds and this process's CPU seconds. With one
    torch thread on a shared machine the CPU seconds are what the work costs (the wall seconds
    also count the time other processes held the cores); on a GPU only the wall seconds mean
    anything.

    Parameters
    ----------
    cfg : ExperimentConfig
        The config (its local runtime runs here whatever ``comm_args.backend`` says). Modified:
        ``device_args.num_threads`` is set to ``threads``, and ``train_args.comm_round`` is raised
        so that no measured round is the last (whose ``finalize`` is not a round's work).
    rounds : int
        Measured rounds (after ``warmup`` rounds that are run and replayed but not counted).
    threads : int
        torch CPU threads for round and reference (0 keeps torch's default).
    variants : sequence of str
        Reference variants (see the module docstring); the first is the headline ``ratio``'s.
    reference_repeats : int
        Replays of each variant after each round (their median counts).
    profile : bool
        Also run one more round under cProfile (not counted) and return its top functions.

    Returns
    -------
    dict
        ``seconds_per_round`` / ``cpu_seconds_per_round``, ``reference_seconds`` /
        ``reference_cpu_seconds`` (per variant), ``ratio`` / ``ratio_cpu`` (per variant: the median
        of the per-round ratios), ``ratio_best`` / ``ratio_best_cpu`` (against each round's fastest
        variant; ``best_variants`` names it, by CPU seconds), ``images_per_second`` (images through
        a forward with gradient per second, round and references), ``breakdown`` (median CPU
        seconds per round of forward, backward, optimiser, augmentation, plain inputs, recording,
        and the rest), ``workload``
        (the passes of the last measured round), ``peak_rss_mb``, ``cuda_max_memory_mb`` (on GPU),
        ``machine``, and the per-round figures under ``per_round``.
    """
    if rounds < 1 or warmup < 0 or reference_repeats < 1:
        raise ConfigError("bench: --rounds and --repeats must be >= 1 and --warmup >= 0")
    names = list(variants)
    for name in names:
        parse_variant(name)
    if threads:
        cfg.device_args.num_threads = threads
        torch.set_num_threads(threads)
    total = warmup + rounds + (1 if profile else 0)
    if cfg.train_args.comm_round <= total:
        cfg.train_args.comm_round = total + 1
    machine = machine_info(threads or torch.get_num_threads())
    exp = build_experiment(cfg)
    algo = exp.algorithm
    algo.setup()
    cuda = exp.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(exp.device)
    model_type = type(algo.model_fn())
    pipeline = InputPipeline(exp.data_info, exp.device)
    gen = torch.Generator().manual_seed(12345)
    images = exp.dataset.train_images
    factory = model_factory(cfg, exp.data_info)
    with torch.random.fork_rng(devices=[]):
        layout = getattr(cfg.device_args, "memory_format", "unchanged")  # a config from before the key: as then
        autocast = getattr(cfg.device_args, "autocast", "off")
        refs = [Reference(name, factory(), exp.device, layout, autocast) for name in names]
    per_round: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fedml_ssfl_bench_") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        states = run_client_states(cfg, run_dir, None)  # a dict, or a store under device_args.state_memory_mb
        rec = RunRecorder(cfg, exp, run_dir)
        try:
            for r in range(total):
                profiled = profile and r == total - 1
                clock = time.perf_counter if cuda else time.process_time
                with _profiled(profiled, profile_top, result), PassRecorder(model_type, clock) as counter:
                    t0, c0 = time.perf_counter(), time.process_time()
                    row = run_round(exp, r, states)
                    c1, mid = time.process_time(), sum(counter.timers.values())
                    rec.record(r, row, cfg.train_args.comm_round, states)
                    if cuda:
                        torch.cuda.synchronize(exp.device)
                    t2, c2 = time.perf_counter(), time.process_time()
                if profiled:
                    break
                work = counter.workload
                entry: dict[str, Any] = {
                    "round": r,
                    "warmup": r < warmup,
                    "seconds": t2 - t0,
                    "cpu_seconds": c2 - c0,
                    # the recording's own cost: evaluation's passes and inputs are in the timers
                    "record_cpu_seconds": c2 - c1 - (sum(counter.timers.values()) - mid),
                    "timers": dict(counter.timers),
                    "workload": work.summary(),
                    "reference_seconds": {},
                    "reference_cpu_seconds": {},
                }
                for ref in refs:
                    times = []
                    for _ in range(reference_repeats):
                        t = ref.run(work, images, pipeline, gen)
                        if "compile" in ref.flags and ref.compile_seconds is None:
                            ref.compile_seconds = t[0]  # the first replay compiles: reported apart
                            t = ref.run(work, images, pipeline, gen)
                        times.append(t)
                    entry["reference_seconds"][ref.name] = _median([w for w, _ in times])
                    entry["reference_cpu_seconds"][ref.name] = _median([c for _, c in times])
                entry["best_seconds"] = min(entry["reference_seconds"].values())
                entry["best_cpu_seconds"] = min(entry["reference_cpu_seconds"].values())
                entry["best_variant"] = min(entry["reference_cpu_seconds"], key=entry["reference_cpu_seconds"].get)
                per_round.append(entry)
                log.info(
                    "round %d%s: %.2f s (CPU %.2f s); reference %s",
                    r,
                    " (warm-up)" if r < warmup else "",
                    entry["seconds"],
                    entry["cpu_seconds"],
                    ", ".join(
                        f"{k} {v:.2f} s (CPU {entry['reference_cpu_seconds'][k]:.2f} s)"
                        for k, v in entry["reference_seconds"].items()
                    ),
                )
        finally:
            rec.close()
            close_client_states(states)
    measured = [e for e in per_round if not e["warmup"]]
    images_grad = _median([e["workload"]["images_grad"] for e in measured])

    def med(key: str, name: str | None = None) -> float:
        return _median([e[key] if name is None else e[key][name] for e in measured])

    def ratio(key: str, ref_key: str, name: str | None = None) -> float:
        refs = [e[ref_key] if name is None else e[ref_key][name] for e in measured]
        return _median([e[key] / r for e, r in zip(measured, refs) if r > 0])

    result.update(
        {
            "config": {
                "algorithm": cfg.algorithm,
                "model": f"{cfg.model_args.model}-{cfg.model_args.norm}",
                "dataset": cfg.data_args.dataset,
                "clients_per_round": cfg.train_args.client_num_per_round,
                "local_steps": cfg.train_args.local_steps,
                "batch_size": cfg.train_args.batch_size,
                "device": str(exp.device),
            },
            "rounds": rounds,
            "warmup": warmup,
            "reference_repeats": reference_repeats,
            "seconds_per_round": med("seconds"),
            "cpu_seconds_per_round": med("cpu_seconds"),
            "reference_seconds": {n: med("reference_seconds", n) for n in names},
            "reference_cpu_seconds": {n: med("reference_cpu_seconds", n) for n in names},
            "ratio": {n: ratio("seconds", "reference_seconds", n) for n in names},
            "ratio_cpu": {n: ratio("cpu_seconds", "reference_cpu_seconds", n) for n in names},
            "reference_best_seconds": med("best_seconds"),
            "reference_best_cpu_seconds": med("best_cpu_seconds"),
            "ratio_best": ratio("seconds", "best_seconds"),
            "ratio_best_cpu": ratio("cpu_seconds", "best_cpu_seconds"),
            "best_variants": [e["best_variant"] for e in measured],
            "images_per_second": {
                "round": images_grad / med("seconds"),
                **{n: images_grad / med("reference_seconds", n) for n in names},
            },
            "breakdown": _breakdown(measured),
            "workload": measured[-1]["workload"],
            "peak_rss_mb": peak_rss_mb(),
            "machine": {**machine, "loadavg_end": list(os.getloadavg())},
            "per_round": per_round,
        }
    )
    compiled = {ref.name: ref.compile_seconds for ref in refs if ref.compile_seconds is not None}
    if compiled:
        result["compile_seconds"] = compiled
    if cuda:
        result["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated(exp.device) / 2**20
    return result


def _breakdown(measured: list[dict[str, Any]]) -> dict[str, float]:
    """Median CPU seconds per round of each timer, of the recording (evaluation apart from its passes and
    inputs, logs, checkpoint), and the rest."""
    out = {k: _median([e["timers"][k] for e in measured]) for k in measured[0]["timers"]}
    out["record"] = _median([e["record_cpu_seconds"] for e in measured])
    rest = [e["cpu_seconds"] - sum(e["timers"].values()) - e["record_cpu_seconds"] for e in measured]
    out["other"] = _median(rest)
    return out


# ---------------------------------------------------------------------------------------------
# time to first round


_FIRST_ROUND_CODE = """
import os, sys, time
import fedml_ssfl.runtime.local as local

def first_round(*args, **kwargs):
    mods = sorted({m.split(".")[0] for m in sys.modules})
    print("FEDML_SSFL_FIRST_ROUND", repr(time.time()), " ".join(mods), flush=True)
    os._exit(0)

local.run_round = first_round
from fedml_ssfl.cli import main
sys.exit(main(["run", *sys.argv[1:]]))
"""


def first_round_seconds(
    config: str | None,
    overrides: Sequence[str] = (),
    importtime: bool = False,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """Wall seconds from starting ``fedml-ssfl run CONFIG`` to the start of its first round.

    A fresh interpreter runs the command line's ``main`` with the local runtime's ``run_round``
    replaced by a stop that reports the time and the top-level modules imported so far.

    Parameters
    ----------
    config : str or None
        The config path (None: the main job).
    overrides : sequence of str
        ``section.key=value`` overrides (``--set``).
    importtime : bool
        Run under ``python -X importtime`` and return the slowest top-level imports (cumulative
        microseconds; this slows the run a little).
    env : dict, optional
        Extra environment variables.
    python : str, optional
        The interpreter to start (default: this one).

    Returns
    -------
    dict
        ``seconds``, ``modules`` (top-level modules imported by then), ``heavy`` (those of
        :data:`HEAVY_MODULES`), and with ``importtime`` ``imports_us`` (package -> microseconds).
    """
    args = [config] if config else []
    for o in overrides:
        args += ["--set", o]
    cmd = [python or sys.executable, *(["-X", "importtime"] if importtime else []), "-c", _FIRST_ROUND_CODE, *args]
    full_env = {**os.environ, **(env or {})}
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("FEDML_SSFL_FIRST_ROUND")), None)
    if line is None:
        raise RuntimeError(f"first_round_seconds: the run never reached its first round:\n{res.stdout}{res.stderr}")
    _, stamp, *mods = line.split(" ")
    out: dict[str, Any] = {
        "seconds": float(stamp) - t0,
        "modules": mods,
        "heavy": [m for m in HEAVY_MODULES if m in mods],
    }
    if importtime:
        out["imports_us"] = _top_imports(res.stderr)
    return out


def _top_imports(stderr: str, top: int = 15) -> dict[str, int]:
    """Each package's cumulative import time (us) from ``-X importtime`` output, slowest first.

    A package is a name without a dot, wherever in the import tree it was first imported (its
    cumulative time includes what it imported, so the figures overlap: torch's includes numpy's).
    """
    found: dict[str, int] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        name = name.strip()
        if cumulative.strip().isdigit() and "." not in name and not name.startswith("_"):
            found[name] = found.get(name, 0) + int(cumulative)
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:top])


# ---------------------------------------------------------------------------------------------
# `fedml-ssfl bench`


def format_bench(result: dict[str, Any]) -> str:
    """A short text table of :func:`measure_round_speed`'s result."""
    c, m = result["config"], result["machine"]
    w = result["workload"]
    lines = [
        f"{c['algorithm']} {c['model']} on {c['dataset']}, {c['device']}, {m['torch_threads']} torch thread(s), "
        f"load average {m['loadavg'][0]:.2f} -> {m['loadavg_end'][0]:.2f}; medians of {result['rounds']} rounds",
        f"per round: {w.get('forwards_grad', 0)} forwards with gradient ({w.get('images_grad', 0)} images), "
        f"{w.get('forwards_nograd', 0)} without ({w.get('images_nograd', 0)} images), "
        f"{w.get('optimizer_steps', 0)} optimiser steps",
        f"{'':<36}{'s/round':>9}{'CPU s':>9}{'img/s':>8}{'ratio':>8}{'CPU ratio':>10}",
        f"{'round':<36}{result['seconds_per_round']:>9.3f}{result['cpu_seconds_per_round']:>9.3f}"
        f"{result['images_per_second']['round']:>8.0f}",
    ]
    for name, sec in result["reference_seconds"].items():
        lines.append(
            f"{'reference ' + name:<36}{sec:>9.3f}{result['reference_cpu_seconds'][name]:>9.3f}"
            f"{result['images_per_second'][name]:>8.0f}{result['ratio'][name]:>7.2f}x{result['ratio_cpu'][name]:>9.2f}x"
        )
    lines.append(
        f"{'reference: fastest variant':<36}{result['reference_best_seconds']:>9.3f}"
        f"{result['reference_best_cpu_seconds']:>9.3f}{'':>8}{result['ratio_best']:>7.2f}x"
        f"{result['ratio_best_cpu']:>9.2f}x  ({', '.join(sorted(set(result['best_variants'])))})"
    )
    b = result["breakdown"]
    lines.append("round breakdown (CPU s): " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()))
    lines.append(f"peak RSS {result['peak_rss_mb']:.0f} MiB")
    if "cuda_max_memory_mb" in result:
        lines.append(f"CUDA max memory {result['cuda_max_memory_mb']:.0f} MiB")
    for name, sec in result.get("compile_seconds", {}).items():
        lines.append(f"compile ({name}): first replay {sec:.1f} s")
    if "profile" in result:
        lines.append(result["profile"])
    return "\n".join(lines)


def run_bench(
    cfg: ExperimentConfig, variants: str = ",".join(DEFAULT_VARIANTS), json_path: Path | None = None, **kw: Any
) -> int:
    """``fedml-ssfl bench``: :func:`measure_round_speed` (``kw``: its options), print the table, write ``json_path``.

    ``variants`` is comma-separated, as the command line gives it.
    """
    names = [v.strip() for v in variants.split(",") if v.strip()]
    result = measure_round_speed(cfg, variants=names, **kw)
    print(format_bench(result))
    if json_path is not None:
        json_path = Path(json_path)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"figures: {json_path}")
    return 0
