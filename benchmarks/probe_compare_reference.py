"""Why the server_only compare run of ``configs/mnist5k/fedavg_fixmatch.yaml`` ends far below server_only.yaml.

``fedml-ssfl run CONFIG`` also runs each ``common_args.compare_with`` baseline with the config's own
data, model and ``train_args`` (``ExperimentConfig.with_algorithm``: only ``ssfl_args`` is reset).
The naive baselines' configs (FedAvg / FedProx x FixMatch / UDA, FedMatch's protocol) train with
plain SGD (``train_args.momentum: 0``) because their server weighs its labelled loss by
``lambda_s = 10``; server_only has no ``lambda_s``, so its compare run takes steps about ten times
smaller than server_only.yaml's (lr 0.03 with momentum 0.9: a steady-state step of lr / (1 - 0.9)).

Arms (each a server_only run, seed by seed, the compare config with overrides):

* ``compare run``: exactly the compare config (momentum 0, lr 0.03);
* ``momentum 0.9``: the compare config with ``train_args.momentum=0.9`` (this is server_only.yaml's
  config: the script checks the two configs are equal);
* ``lr 0.3, momentum 0``: plain SGD at ``lambda_s x lr``, the step the method's server takes on its
  labelled loss.

Writes ``benchmarks/results/probe_compare_reference.json`` (or ``--out``); rerunning adds or replaces
the arms and seeds it runs.

Usage::

    nice python benchmarks/probe_compare_reference.py --seeds 0
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {
    "compare run (momentum 0, lr 0.03)": [],
    "momentum 0.9 (server_only.yaml's config)": ["train_args.momentum=0.9"],
    "lr 0.3, momentum 0 (lambda_s x lr)": ["train_args.learning_rate=0.3"],
}


def compare_config(config: Path, seed: int, out_dir: str, extra: list[str]):
    """The config ``fedml-ssfl run`` uses for ``config``'s server_only compare run, with ``extra`` overrides."""
    from fedml_ssfl.config import load_config, validate

    base = [
        "tracking_args.progress_bar=false",
        "tracking_args.enable_tensorboard=false",
        f"common_args.output_dir={out_dir}",
        f"common_args.random_seed={seed}",
    ]
    raw = load_config(config, base).with_algorithm("server_only", run_name="server_only").to_dict()
    for item in extra:
        key, _, value = item.partition("=")
        section, name = key.split(".")
        raw[section][name] = float(value)
    return validate(raw)


def _key(cfg) -> str:
    d = cfg.to_dict()
    d["common_args"].pop("run_name", None)
    return json.dumps(d, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    from fedml_ssfl.config import load_config
    from fedml_ssfl.runtime.local import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "mnist5k" / "fedavg_fixmatch.yaml"))
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--out-dir", default="/tmp/fedml_ssfl_probe_compare")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_compare_reference.json"))
    args = parser.parse_args(argv)
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(
        config=str(Path(args.config).resolve().relative_to(ROOT)),
        machine=f"{platform.machine()}, 1 torch thread, torch {torch.__version__}",
        date=time.strftime("%Y-%m-%d"),
    )
    runs = data.setdefault("runs", {})
    for seed in args.seeds:
        so = load_config(
            ROOT / "configs" / "mnist5k" / "server_only.yaml",
            [
                "tracking_args.progress_bar=false",
                "tracking_args.enable_tensorboard=false",
                f"common_args.output_dir={args.out_dir}",
                f"common_args.random_seed={seed}",
            ],
        )
        for arm, extra in ARMS.items():
            cfg = compare_config(Path(args.config), seed, args.out_dir, extra)
            t0 = time.perf_counter()
            slug = "".join(c if c.isalnum() else "_" for c in arm)[:60]
            res = run_local(cfg, run_dir=Path(args.out_dir) / f"{slug}-s{seed}")
            metrics = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
            curve = [m.get("test_acc") for m in metrics if m.get("test_acc") is not None]
            runs[f"{arm} | seed {seed}"] = {
                "arm": arm,
                "seed": seed,
                "momentum": cfg.train_args.momentum,
                "learning_rate": cfg.train_args.learning_rate,
                "same_config_as_server_only_yaml": _key(cfg) == _key(so.with_algorithm("server_only", "x")),
                "final_acc": res.final_acc,
                "best_acc": res.best_acc,
                "test_acc_by_round": curve,
                "wall_seconds": time.perf_counter() - t0,
            }
            print(f"seed {seed}: {arm}: {100 * res.final_acc:.1f}%", flush=True)
            path.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
