"""Probe: does a client round undo what the server's step just taught the model?

Runs a config in the local simulator and evaluates the test accuracy of the global model twice
a round: right after the server's own step (the model the round broadcasts) and after the
clients' replies are aggregated. It also records the two parts of the round's update over the
model's parameters: ``||server step||`` (the broadcast model minus the round's starting model),
``||clients||`` (the aggregate minus the broadcast model) and the cosine of the two (negative: the
clients undo the server's step), beside the clients' mean diagnostics (loss terms, mask rate).
``--set train_args.idle_clients=true`` gives the same with idle clients. For FedMatch it also logs
``||sigma||``, ``||psi||`` and the psi pull per round ``c = 1 - (1 - 2 lambda_L2 lr)^T``. A method
whose clients keep knocking the server's model down shows "after server" well above "after
clients" round after round.

Writes ``benchmarks/results/probe_server_step.json`` (one entry per ``--tag``).

Usage::

    python benchmarks/probe_server_step.py configs/mnist5k/fedmatch.yaml --rounds 8 --tag fedmatch
    python benchmarks/probe_server_step.py configs/mnist5k/fedmatch.yaml --set ssfl_args.momentum=0.9 --tag m09
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.algorithms.base import ClientContext  # noqa: E402
from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.experiment import build_experiment  # noqa: E402
from fedml_ssfl.metrics import evaluate  # noqa: E402
from fedml_ssfl.runtime.common import finish_round, start_round  # noqa: E402


def test_acc(exp, state: dict | None = None) -> float:
    algo, ds = exp.algorithm, exp.dataset
    model = algo.global_model()
    if state is not None:
        model.load_state_dict(state)
    return evaluate(model, ds.test_images, ds.test_labels, exp.data_info, exp.device)["acc"]


def norm(tensors: dict) -> float:
    return float(torch.sqrt(sum((t.float() ** 2).sum() for t in tensors.values())))


def delta(a: dict, b: dict, keys: list[str]) -> dict:
    return {k: a[k].double() - b[k].double() for k in keys}


def cos(u: dict, v: dict) -> float:
    nu, nv = norm(u), norm(v)
    return float(sum((u[k] * v[k]).sum() for k in u) / (nu * nv)) if nu > 0 and nv > 0 else float("nan")


def probe(cfg, rounds: int) -> list[dict]:
    exp = build_experiment(cfg)
    algo = exp.algorithm
    algo.setup()
    states: dict[int, dict] = {k: {} for k in range(cfg.train_args.client_num_in_total)}
    params = [k for k, _ in algo.model_fn().named_parameters()]
    rows = []
    for r in range(rounds):
        before = {k: algo.global_state[k].clone() for k in params}
        start = start_round(exp, r)
        # the model this round broadcasts: the server's trained model where it keeps one aside
        trained = getattr(algo, "_server_state", None)
        sent = {k: (trained or algo.global_state)[k].clone() for k in params}
        row = {"round": r, "after_server": test_acc(exp, trained)}
        if hasattr(algo, "psi"):
            row["sigma_norm"], row["psi_norm"] = norm(algo.sigma), norm(algo.psi)
        ctx = ClientContext(round_idx=r, device=exp.device, seed=cfg.common_args.random_seed)
        replies = {
            k: algo.run_client_update(start.messages[k], exp.client_data(k, r), states[k], ctx) for k in start.chosen
        }
        metrics = finish_round(exp, start, replies, 0)
        # the clients' part: what aggregation made of the sent model (FedSiam keeps it as agg_online
        # until its next server step)
        after = getattr(algo, "agg_online", None) or algo.global_state
        server_part, client_part = delta(sent, before, params), delta(after, sent, params)
        row["server_delta_norm"], row["clients_delta_norm"] = norm(server_part), norm(client_part)
        row["cos_clients_with_server_delta"] = cos(client_part, server_part)
        row["after_clients"] = test_acc(exp, after if "agg_online" in vars(algo) else None)
        if hasattr(algo, "psi"):
            row["psi_norm_after"] = norm(algo.psi)
        for key, value in metrics.items():
            if key.startswith("client_") and isinstance(value, float):
                row[key] = value
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tag", default="latest")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_server_step.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(args.config, ["common_args.compare_with=[]", *args.overrides])
    rows = probe(cfg, min(args.rounds, cfg.train_args.comm_round))
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[args.tag] = {"config": args.config, "overrides": args.overrides, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
