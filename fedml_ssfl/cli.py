"""The ``fedml-ssfl`` command line.

``fedml-ssfl run`` with no arguments runs the default main job (offline, shipped MNIST-5k)
and prints the server-only accuracy beside the SSFL method's, from the same data split.
``fedml-ssfl`` alone prints the help (exit 0); ``fedml-ssfl list`` names what can be run.

Every error is one line on stderr, ``fedml-ssfl: error: <what and the fix>``
(:func:`fedml_ssfl.errors.error_line`): exit 2 for a usage or config error (nothing ran),
1 for a command that ran and failed.
"""

from __future__ import annotations

import argparse
import errno
import logging
import re
import sys
from pathlib import Path

from . import __version__, envvars
from .config import ConfigError, ExperimentConfig, load_config
from .errors import PROG, error_line, error_lines

log = logging.getLogger("fedml_ssfl")

DEFAULT_JOB = Path(__file__).resolve().parent / "configs" / "default_job.yaml"
"""The main job `fedml-ssfl run` runs with no config (also at configs/mnist5k/semifl.yaml)."""


def _add_config_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("config", nargs="?", help="experiment YAML (default: the main job, configs/mnist5k/semifl.yaml)")
    p.add_argument(
        "--cf",
        "--yaml_config_file",
        dest="cf",
        help="experiment YAML (FedML's flags; same as the positional CONFIG)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set train_args.comm_round=5 (repeatable)",
    )


def _config_path(args: argparse.Namespace) -> str | None:
    if args.config and args.cf and args.config != args.cf:
        raise ConfigError(f"two configs given ({args.config} and --cf {args.cf}); pass one")
    return args.cf or args.config or str(DEFAULT_JOB)


LISTS = ("algorithms", "models", "datasets", "partitions")
"""What ``fedml-ssfl list`` lists."""


class _Parser(argparse.ArgumentParser):
    """argparse with the package's error style: one line, ``fedml-ssfl: error: ...``, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, error_line(f"{message} (see `{self.prog} --help`)") + "\n")


def _examples(*lines: tuple[str, str], width: int = 50) -> str:
    """An epilog: ``examples:`` and a ``command  # what it does`` line each (a long command: the comment below)."""
    width = min(width, max(len(cmd) for cmd, _ in lines))
    out = ["examples:"]
    for cmd, what in lines:
        note = f"  # {what}" if what else ""
        if len(cmd) > width and note:
            out += [f"  {cmd}", f"  {'':<{width}}{note}"]
        else:
            out.append(f"  {cmd:<{width}}{note}".rstrip())
    return "\n".join(out)


TOP_EPILOG = (
    _examples(
        ("fedml-ssfl run", "the main job: SemiFL and server-only on MNIST-5k, offline"),
        ("fedml-ssfl run configs/mnist5k/fedavg_ssl.yaml", "any config (FedML's --cf works too)"),
        ("fedml-ssfl run --set ssfl_args.algorithm=fedavg_ssl", "writes runs/mnist5k_fedavg_ssl/"),
        ("fedml-ssfl list algorithms", "what ssfl_args.algorithm accepts"),
        ("fedml-ssfl partition", "the data split; heat-map beside the run folder"),
        ("fedml-ssfl report runs/mnist5k_semifl", "a table and an accuracy plot"),
        ("fedml-ssfl export runs/mnist5k_semifl --out edge/", "ONNX for edge devices"),
        ("fedml-ssfl run --help", "each command's options and examples"),
    )
    + """

A run writes runs/<run_name>/; without common_args.run_name the name is <dataset>_<algorithm>.
Exit status: 0 done (also bare `fedml-ssfl`, which prints this help); 1 the command ran and
failed; 2 a usage or config error (nothing ran). Errors are one line: `fedml-ssfl: error: ...`."""
)

RUN_EPILOG = (
    _examples(
        ("fedml-ssfl run", "the main job (configs/mnist5k/semifl.yaml)"),
        ("fedml-ssfl run configs/mnist5k/fedavg_ssl.yaml", "writes runs/mnist5k_fedavg_ssl/"),
        ("fedml-ssfl run --set data_args.dataset=digits --set train_args.comm_round=2", "writes runs/digits_semifl/"),
        ("fedml-ssfl run --stop-after 5", "stop after 5 rounds (a checkpoint is kept) ..."),
        ("fedml-ssfl run --resume runs/mnist5k_semifl", "... and continue it"),
        ("fedml-ssfl run --print-config --set ssfl_args.algorithm=fedmatch", "the resolved config"),
    )
    + """

Run name: a config's own common_args.run_name is kept unless --set changes data_args.dataset or
ssfl_args.algorithm; then, as for a config without one, it is <dataset>_<algorithm>.
--set common_args.run_name=NAME always wins. A taken name gets a new folder NAME-2, NAME-3 ...;
a run that fails before writing anything (data, model, device, setup) leaves no folder."""
)

PARTITION_EPILOG = (
    _examples(
        ("fedml-ssfl partition", "the main job's split; runs/mnist5k_semifl.partition.png"),
        ("fedml-ssfl partition configs/cifar10/crl_gn.yaml", "a paper's setting (needs its data on disk)"),
        ("fedml-ssfl partition --set data_args.partition_method=dirichlet --out split.png", ""),
        ("fedml-ssfl partition configs/mnist5k/fedavg_ssl.yaml --export /tmp/silos", "per-silo files + config"),
    )
    + """

The heat-map goes beside the run folder, <output_dir>/<run_name>.partition.png, never into it,
so the next `fedml-ssfl run` of the same config still gets <output_dir>/<run_name>/."""
)

REPORT_EPILOG = _examples(
    ("fedml-ssfl report runs/mnist5k_semifl", "the run and its compare/ baselines"),
    ("fedml-ssfl report runs/mnist5k_semifl runs/mnist5k_fedavg_ssl --out cmp.png", "several runs"),
)

EXPORT_EPILOG = _examples(
    ("fedml-ssfl export runs/mnist5k_fedavg_ssl --out export/", "ONNX, .ort and int8, verified"),
    ("fedml-ssfl export runs/mnist5k_fedavg_ssl/checkpoints/last.pt --no-int8", "from a checkpoint file"),
)

LIST_EPILOG = _examples(
    ("fedml-ssfl list", "all four"),
    ("fedml-ssfl list algorithms", "the values of ssfl_args.algorithm"),
    ("fedml-ssfl list partitions", "the values of data_args.partition_method"),
)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description="Semi-supervised federated learning on FedML",
        epilog=TOP_EPILOG,
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_global_flags(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run an experiment (default: the offline MNIST-5k main job)",
        description="Run an experiment: the local simulator, or this process's part of a FedML job.",
        epilog=RUN_EPILOG,
        formatter_class=raw,
    )
    _add_config_args(run)
    run.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="RUN_DIR",
        help="continue a stopped run from its last checkpoint (default RUN_DIR: the config's run dir)",
    )
    run.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="stop after round N in all (a checkpoint is written there); continue later with --resume",
    )
    run.add_argument(
        "--replay",
        default=None,
        metavar="PARTICIPATION_FILE",
        help="the simulator follows a recorded participation.jsonl exactly (train_args.replay_participation)",
    )
    run.add_argument("--no-compare", action="store_true", help="skip the baselines in common_args.compare_with")
    run.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    run.add_argument("--rank", type=int, default=None, help="FedML GRPC: this process's rank (0 = server)")
    run.add_argument("--role", choices=("server", "client"), default=None, help="FedML GRPC: this process's role")
    _add_fedml_launch_args(run)

    part = sub.add_parser(
        "partition",
        help="print the data split: sizes, class histograms, R; save a heat-map",
        description="Print a config's data split (sizes, class histograms, non-iid R) and save its heat-map.",
        epilog=PARTITION_EPILOG,
        formatter_class=raw,
    )
    _add_config_args(part)
    part.add_argument("--out", help="heat-map PNG path (default: <output_dir>/<run_name>.partition.png)")
    part.add_argument(
        "--export",
        metavar="DIR",
        help="also write the split as deployment files (one npz per silo, the server's, the test set) and "
        "DIR/deployment.yaml, the config that runs them in FedML's deployment mode",
    )
    part.add_argument(
        "--backend", choices=("MPI", "GRPC"), default="MPI", help="the FedML backend of the exported config"
    )

    report = sub.add_parser(
        "report",
        help="compare runs: one table and one accuracy-vs-round plot",
        description="Compare finished runs: one table and one accuracy-vs-round plot.",
        epilog=REPORT_EPILOG,
        formatter_class=raw,
    )
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    report.add_argument("--out", type=Path, help="plot path (default: next to the first run)")
    report.add_argument("--no-compare", action="store_true", help="leave out each run's compare/ baselines")

    export = sub.add_parser(
        "export",
        help="a trained run or checkpoint to ONNX (+ .ort, int8) for edge devices",
        description="Export a trained run or checkpoint to ONNX (+ .ort, int8) for edge devices, verified.",
        epilog=EXPORT_EPILOG,
        formatter_class=raw,
    )
    add_export_arguments(export)

    listing = sub.add_parser(
        "list",
        help="list the algorithms, models, datasets or partition methods, one line each",
        description="List what a config can name, each with a one-line description.",
        epilog=LIST_EPILOG,
        formatter_class=raw,
    )
    listing.add_argument(
        "what", nargs="?", choices=LISTS, metavar="WHAT", help=f"{', '.join(LISTS)} (default: all four)"
    )
    _add_bench_command(sub)
    _add_reproduce_command(sub)
    for command in sub.choices.values():  # `fedml-ssfl run --debug` as well as `fedml-ssfl --debug run`
        _add_global_flags(command, argparse.SUPPRESS)
    parser.set_defaults(commands=sub.choices)
    return parser


def _add_global_flags(p: argparse.ArgumentParser, default: object) -> None:
    """``-v`` and ``--debug``: on the top-level parser (``default`` False) and on each subcommand's.

    A subcommand's copies default to ``argparse.SUPPRESS``, so they set the flag only when given there
    and otherwise leave the top-level value alone.
    """
    p.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    p.add_argument("--debug", action="store_true", default=default, help="show the traceback of an unexpected error")


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    """``fedml-ssfl bench CONFIG``: seconds per round against a plain PyTorch loop of the same passes."""
    p = sub.add_parser(
        "bench",
        help="seconds per round against a plain PyTorch loop of the same passes (docs/performance.md)",
        description="Run a config's rounds in this process, each followed by a plain PyTorch loop doing the "
        "same forward/backward passes on already-augmented tensors; print round / loop (the federated overhead).",
    )
    _add_config_args(p)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0: torch's default)")
    p.add_argument(
        "--variants",
        default="contiguous+inference,channels_last+inference",
        help="reference variants, comma-separated; each joins eager, contiguous, channels_last, inference, compile "
        "with '+' (the ratio is against each round's fastest)",
    )
    p.add_argument("--repeats", type=int, default=1, help="reference replays per round and variant (default 1)")
    p.add_argument("--profile", action="store_true", help="also cProfile one more round and print its top functions")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to this JSON file")


def _add_reproduce_command(sub: argparse._SubParsersAction) -> None:
    """``fedml-ssfl reproduce``: the seed papers' table rows, listed or run (``reproduction.py``)."""
    p = sub.add_parser(
        "reproduce",
        help="list or run the seed papers' table rows the configs target; writes docs/reproduction.md",
        description="--list: each paper row's number, config and command. Otherwise run the rows on the "
        "datasets in --data-dir (a row with a result is skipped, a stopped one resumes) and write the "
        "paper-vs-ours page.",
    )
    p.add_argument("--list", action="store_true", help="print the rows, their paper numbers, configs and commands")
    p.add_argument("--data-dir", type=Path, default=None, help="folder holding the datasets (docs/inputs.md)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the rows train (default cpu)")
    p.add_argument("--rows", nargs="+", default=None, metavar="KEY", help="the rows to run (default: all)")
    p.add_argument("--budget", choices=("paper", "smoke"), default="paper", help="smoke: 2 rounds on a tiny split")
    p.add_argument("--work", type=Path, default=Path("runs/reproduce"), help="run folders and result files")
    p.add_argument("--out", type=Path, default=Path("docs/reproduction.md"), help="the page written")
    p.add_argument("--page-only", action="store_true", help="write the page from the results in --work, run nothing")


def cmd_reproduce(args: argparse.Namespace) -> int:
    from . import reproduction

    if args.list:
        print(reproduction.format_list())
        return 0
    if args.page_only:
        reproduction.write_page(args.out, reproduction.load_results(args.work))
        print(f"wrote {args.out}")
        return 0
    if args.data_dir is None:
        raise ConfigError("reproduce: give --data-dir DIR (the datasets' folder), or --list for the rows")
    rows = reproduction.select_rows(args.rows)
    ran, skipped = reproduction.reproduce(rows, args.data_dir, args.device, args.work, args.budget, args.out)
    for key in skipped:
        print(f"{key}: done before ({args.work / 'results' / (key + '.json')}), skipped")
    print(f"ran {len(ran)}, skipped {len(skipped)}; wrote {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    if args.threads < 0:
        raise ConfigError(f"--threads {args.threads}: give a number of torch threads >= 1, or 0 for torch's default")
    opts = {k: getattr(args, k) for k in ("rounds", "warmup", "threads", "profile")}
    cfg = load_config(_config_path(args), args.overrides)
    return run_bench(cfg, args.variants, args.json, reference_repeats=args.repeats, **opts)


def _add_fedml_launch_args(p: argparse.ArgumentParser) -> None:
    """The rest of the flags FedML's launcher passes (``fedml/arguments.py``); see :func:`_fedml_launch_flags`."""
    fedml = p.add_argument_group("FedML launch flags (accepted so that FedML's launch commands run unchanged)")
    fedml.add_argument("--run_id", default=None, help="FedML's run id: kept as common_args.run_id")
    fedml.add_argument("--local_rank", type=int, default=0, help="FedML's rank within a node (ignored unless not 0)")
    fedml.add_argument("--node_rank", type=int, default=0, help="FedML's hierarchical node rank (ignored unless not 0)")
    fedml.add_argument("--run_device_id", default=None, help="FedML's edge (device) id (logged, not used)")
    fedml.add_argument(
        "--using_mlops",
        type=_flag_bool,
        nargs="?",
        const=True,
        default=False,
        metavar="BOOL",
        help="FedML's MLOps switch: true is ignored with a warning (fedml_ssfl runs offline)",
    )


def _flag_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "y", "on"):
        return True
    if value in ("false", "0", "no", "n", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _fedml_launch_flags(args: argparse.Namespace, cfg: ExperimentConfig) -> None:
    """Apply FedML's launch flags to ``cfg``: ``--run_id`` is kept, the others are warned about when they matter.

    Without ``--run_id`` the run id is what ``fedml launch`` exports (``FEDML_CURRENT_RUN_ID``), if set.
    """
    run_id = getattr(args, "run_id", None)
    if run_id is None and not cfg.common_args.run_id:
        from .runtime.fedml.launch import RUN_ID_ENV

        run_id = envvars.text(RUN_ID_ENV, max_length=256) or None
    if run_id is not None:
        cfg.common_args.run_id = str(run_id)
    if getattr(args, "using_mlops", False):
        log.warning("--using_mlops true is ignored: fedml_ssfl runs offline; it logs to TensorBoard and metrics.jsonl")
    for flag in ("local_rank", "node_rank"):
        if getattr(args, flag, 0):
            log.warning(
                "--%s %d is ignored: fedml_ssfl runs one process per rank (horizontal cross-silo); --rank N picks it",
                flag,
                getattr(args, flag),
            )
    if getattr(args, "run_device_id", None) not in (None, "0"):
        log.info("--run_device_id %s: FedML's edge id of this process (recorded, not used)", args.run_device_id)


def cmd_run(args: argparse.Namespace) -> int:
    from .runtime.local import run_local

    replay = [f"train_args.replay_participation={args.replay}"] if args.replay else []
    cfg = load_config(_config_path(args), [*args.overrides, *replay], check_names=True)
    _fedml_launch_flags(args, cfg)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    resume = args.resume is not None
    run_dir = Path(args.resume) if args.resume else None
    if args.stop_after is not None and args.stop_after < 1:
        raise ConfigError(f"--stop-after {args.stop_after}: give a number of rounds >= 1")
    if cfg.comm_args.backend != "local":
        from .runtime.fedml.run import run_fedml

        result = run_fedml(
            cfg, rank=args.rank, role=args.role, run_dir=run_dir, resume=resume, stop_after=args.stop_after
        )
        if result is None:  # a client process: the server prints the results
            return 0
        print(format_results_table(cfg, [result]))
        print(f"outputs: {result.run_dir}")
        return 0
    result = run_local(cfg, run_dir=run_dir, resume=resume, stop_after=args.stop_after)
    results = [result]
    if not args.no_compare:
        for name in cfg.common_args.compare_with:
            if name == cfg.algorithm:
                continue
            sub_cfg = cfg.with_algorithm(name, run_name=name)
            sub_cfg.common_args.output_dir = str(result.run_dir / "compare")
            sub_dir = result.run_dir / "compare" / name
            sub_resume = resume and sub_dir.exists()
            results.insert(0, run_local(sub_cfg, run_dir=sub_dir, resume=sub_resume, stop_after=args.stop_after))
    if len(results) > 1:  # the baselines ran after the run drew its plots: draw them in
        from .tracking import plot_run

        plot_run(result.run_dir, label=cfg.algorithm)
    print(format_results_table(cfg, results))
    print(f"outputs: {result.run_dir}")
    return 0


def format_results_table(cfg: ExperimentConfig, results: list) -> str:
    """The closing table: one row per method, all from the same data split."""
    d = cfg.data_args
    head = (
        f"\n{d.dataset}, {d.num_server_labels} server labels, {cfg.train_args.client_num_in_total} clients, "
        f"{cfg.train_args.comm_round} rounds, seed {cfg.common_args.random_seed} (same split for every row)"
    )
    lines = [head, f"{'method':<16}{'final acc':>10}{'best acc':>10}{'MiB up/round':>14}{'s/round':>9}"]
    for r in results:
        s = r.summary
        lines.append(
            f"{r.algorithm:<16}{100 * r.final_acc:>9.2f}%{100 * r.best_acc:>9.2f}%"
            f"{s.get('bytes_up_per_round', 0) / 2**20:>14.2f}{s.get('seconds_per_round', 0):>9.2f}"
        )
    return "\n".join(lines)


def cmd_partition(args: argparse.Namespace) -> int:
    from .atomic import make_folder
    from .data.partition_report import partition_report, save_partition_heatmap
    from .experiment import load_experiment_dataset, make_split
    from .tracking import dataset_name

    cfg = load_config(_config_path(args), args.overrides)
    dataset = load_experiment_dataset(cfg)
    split = make_split(cfg, dataset)
    print(partition_report(split, dataset.train_labels, dataset.class_names))
    out = Path(args.out) if args.out else partition_plot_path(cfg)
    try:
        make_folder(out.parent)
    except OSError as exc:
        fix = "pass --out another path" if args.out else "set common_args.output_dir to another folder (or pass --out)"
        raise ConfigError(f"cannot write the heat-map {out}: {exc}; or {fix}") from None
    title = f"{cfg.common_args.run_name}: {cfg.data_args.partition_method} split of {dataset_name(cfg.to_dict())}"
    save_partition_heatmap(split, dataset.train_labels, out, title, dataset.class_names)
    print(f"heat-map: {out}")
    if args.export:
        from .experiment import export_deployment
        from .runtime.fedml.launch import mpirun_command

        path = export_deployment(cfg, args.export, backend=args.backend)
        print(f"deployment files and config: {path}")
        if args.backend == "MPI":
            print(f"run it: {mpirun_command(load_config(path), str(path))}")
    return 0


def partition_plot_path(cfg: ExperimentConfig) -> Path:
    """Where ``fedml-ssfl partition`` saves the heat-map by default: beside the run folder, not in it.

    ``<output_dir>/<run_name>.partition.png``: a run of the same config then still gets
    ``<output_dir>/<run_name>/`` (a file there would make it take ``<run_name>-2``).
    """
    run_dir = cfg.run_dir()
    return run_dir.parent / f"{run_dir.name}.partition.png"


def cmd_report(args: argparse.Namespace) -> int:
    from .report import report_runs

    print(report_runs(args.run_dirs, out=args.out, include_compare=not args.no_compare))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mobile_export.export import run_export_from_args

    return run_export_from_args(args, prog=PROG)  # its errors then read `fedml-ssfl: error: ...` too


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    from mobile_export.arguments import add_export_arguments as add  # argparse only: no torch for `--help`

    add(parser)


def _registry_rows(what: str) -> tuple[str, list[tuple[str, str]]]:
    """The config key a list's names go into, and its (name, one-line description) rows."""
    if what == "algorithms":
        from .algorithms.registry import algorithm_description, available_algorithms

        return "ssfl_args.algorithm", [(n, algorithm_description(n)) for n in available_algorithms()]
    if what == "models":
        from .models import available_models, model_spec

        return "model_args.model", [(n, model_spec(n).description) for n in available_models()]
    if what == "datasets":
        from .data import available_datasets, dataset_description

        key = "data_args.dataset; root: data_args.data_cache_dir"
        return key, [(n, dataset_description(n)) for n in available_datasets()]
    from .data.partition_methods import METHOD_TABLE

    return "data_args.partition_method", [(m.name, m.description) for m in METHOD_TABLE]


def _plain(text: str) -> str:
    """A docstring line for the terminal: reST roles and double back-quotes dropped."""
    text = re.sub(r":\w+:`~?\.?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def format_list(what: str) -> str:
    """One list as text: a heading naming the config key, then ``name  description`` per entry."""
    key, rows = _registry_rows(what)
    width = max(len(name) for name, _ in rows)
    lines = [f"{what} ({key}):"] + [f"  {name:<{width}}  {_plain(desc)}".rstrip() for name, desc in rows]
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> int:
    print("\n\n".join(format_list(what) for what in ([args.what] if args.what else LISTS)))
    return 0


COMMANDS = {
    "run": cmd_run,
    "partition": cmd_partition,
    "report": cmd_report,
    "export": cmd_export,
    "list": cmd_list,
    "bench": cmd_bench,
    "reproduce": cmd_reproduce,
}


def os_error_text(exc: OSError) -> str:
    """An :class:`OSError` as one line: the file, the system's reason, and for a full disk the fix."""
    where = exc.filename if exc.filename is not None else ""
    reason = exc.strerror or str(exc)
    text = f"{where}: {reason}" if where else reason
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text += "; free disk space there (or write the outputs elsewhere) and run the command again"
    return text


def main(argv: list[str] | None = None) -> int:
    """The ``fedml-ssfl`` entry point; returns the exit status (0 done, 1 failed, 2 usage or config error)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would blame the top-level parser; the subcommand's help is the useful one
            args.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version (0) or a usage error, already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if args.command is None:  # bare `fedml-ssfl`: say what there is
        parser.print_help()
        return 0
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    from .checkpoint import CheckpointError
    from .runtime.local import RunFailed

    try:
        envvars.check_all()  # a bad variable is refused now, not once the data has loaded
        return COMMANDS[args.command](args)
    except (ConfigError, CheckpointError, RunFailed, FileNotFoundError) as exc:
        for line in error_lines(exc):  # a config's problems, all of them: one line each
            print(line, file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except OSError as exc:  # a file the command could not read or write: a full disk, a permission
        if args.debug:
            raise
        print(error_line(os_error_text(exc)), file=sys.stderr)
        return 1
    except Exception as exc:  # a bug, or an input no check knows yet: one line unless asked for more
        if args.debug:
            raise
        print(
            error_line(f"{type(exc).__name__}: {exc} (run again with --debug for the traceback, and please report it)"),
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
