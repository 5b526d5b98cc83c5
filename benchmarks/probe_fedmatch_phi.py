"""Why FedMatch's unlabeled loss Phi does (or does not) move the model on MNIST-5k: per-round magnitudes.

Runs ``configs/mnist5k/fedmatch.yaml`` (labels-at-server; ``--config`` another) round by round with
the local simulator's own round (:func:`fedml_ssfl.runtime.local.run_round`) and records, for each
variant:

* per client psi step of one client (``--client``, default 0), the value of each term of Eq. 5 and the
  norm of its gradient with respect to psi, weighted as the loss weighs it: ``lambda_a x CE(agreement
  label, f(A(u)))``, ``lambda_i x KL(helpers || local)``, ``lambda_L2 ||sigma - psi||^2``,
  ``lambda_L1 ||psi||_1``; the ratio of the L2 pull's gradient to Phi's; the mask rate; in rounds
  with helpers, how often each helper's class agrees with the local model's and how many confident
  samples' agreement label differs from the local model's own class (what the helpers change);
* per round, the parts of the update: ``||Delta sigma||`` of the server's step, ``||Delta psi||`` of
  the clients' average and its cosine with ``sigma - psi`` (1: the clients' whole move is the pull
  onto sigma), the global psi's density after its hard threshold, and the test accuracy;
* per variant, the final model's test predictions, and how many of them differ from the first
  variant's (the default).

Variants are ``NAME=OVERRIDE[,OVERRIDE...]`` (``--set`` style). It writes
``benchmarks/results/probe_fedmatch_phi.json`` (or ``--out``).

Usage::

    nice python benchmarks/probe_fedmatch_phi.py                       # default, lambda_a 1, lambda_a 10
    nice python benchmarks/probe_fedmatch_phi.py --rounds 5 --variant "tau 0.75=ssfl_args.tau=0.75"
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_VARIANTS = ["default=", "lambda_a 1=ssfl_args.lambda_a=1", "lambda_a 10=ssfl_args.lambda_a=10"]


def _norm(grads: tuple[torch.Tensor | None, ...]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))


class ProbeLoss:
    """FedMatch's step losses (delegated to :class:`~fedml_ssfl.algorithms.fedmatch.FedMatchLoss`) that
    record each Eq. 5 term and its gradient norm on the steps of the probed client (``active``)."""

    def __init__(self, inner: Any, rows: list[dict]) -> None:
        self.inner, self.rows, self.active, self.round = inner, rows, False, 0

    def sigma(self, net, sigma, psi, batch):
        return self.inner.sigma(net, sigma, psi, batch)

    def psi(self, net, sigma, psi, helpers, batch):
        from fedml_ssfl.algorithms.fedmatch import phi, psi_regularisers

        loss_u, terms, pl = self.inner.psi(net, sigma, psi, helpers, batch)
        if not self.active:
            return loss_u, terms, pl
        c = self.inner
        params = [psi[n] for n in psi]
        x_plain = batch["x_plain"]
        n_b = x_plain.shape[0]
        with torch.no_grad():
            helper_probs = [net(hw, x_plain, False).float().softmax(dim=1) for hw in helpers]
        w = {n: sigma[n].detach() + psi[n] for n in psi}
        logits_plain, logits_strong = net(w, torch.cat([x_plain, batch["x_strong"]]), True).split(n_b)
        loss_a, loss_i, pl2 = phi(logits_plain, logits_strong, helper_probs, c.tau, c.phi_average)
        l2, l1 = psi_regularisers(sigma, psi)
        parts = {
            "agree": c.lambda_a * loss_a,
            "kl": c.lambda_i * loss_i,
            "l2": c.lambda_l2 * l2,
            "l1": c.lambda_l1 * l1,
        }
        row: dict[str, Any] = {"round": self.round + 1, "mask_rate": float(pl2.mask.float().mean())}
        for name, term in parts.items():
            row[f"{name}_value"] = float(term)
            row[f"{name}_grad"] = (
                _norm(torch.autograd.grad(term, params, retain_graph=True, allow_unused=True))
                if term.requires_grad
                else 0.0
            )
        phi_grad = (
            _norm(torch.autograd.grad(parts["agree"] + parts["kl"], params, retain_graph=True, allow_unused=True))
            if (parts["agree"] + parts["kl"]).requires_grad
            else 0.0
        )
        row["phi_grad"] = phi_grad
        row["pull_over_phi"] = row["l2_grad"] / phi_grad if phi_grad > 0 else None  # None: Phi is exactly 0
        row["sigma_minus_psi"] = float(torch.sqrt(sum(((sigma[n].detach() - psi[n].detach()) ** 2).sum() for n in psi)))
        if helper_probs:
            local = logits_plain.detach().argmax(dim=1)
            row["helper_agrees_with_local"] = [float((h.argmax(dim=1) == local).float().mean()) for h in helper_probs]
            kept = pl2.mask
            row["vote_differs_from_local"] = (
                float((pl2.labels[kept] != local[kept]).float().mean()) if kept.any() else 0.0
            )
        self.rows.append(row)
        return loss_u, terms, pl


def flat_norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((a[n].double() - b[n].double()) ** 2).sum() for n in a)))


def cosine(u: dict[str, torch.Tensor], v: dict[str, torch.Tensor]) -> float:
    dot = sum((u[n].double() * v[n].double()).sum() for n in u)
    nu = torch.sqrt(sum((u[n].double() ** 2).sum() for n in u))
    nv = torch.sqrt(sum((v[n].double() ** 2).sum() for n in v))
    return float(dot / (nu * nv)) if nu > 0 and nv > 0 else float("nan")


def run_variant(
    name: str, config: str, overrides: list[str], rounds: int | None, client: int, seed: int, out_dir: str
) -> dict:
    from fedml_ssfl.config import load_config
    from fedml_ssfl.experiment import build_experiment
    from fedml_ssfl.metrics import evaluate
    from fedml_ssfl.runtime.local import run_round

    base = [
        "common_args.compare_with=[]",
        "tracking_args.progress_bar=false",
        "tracking_args.enable_tensorboard=false",
        f"common_args.output_dir={out_dir}",
        f"common_args.random_seed={seed}",
    ]
    if rounds:
        base.append(f"train_args.comm_round={rounds}")
    cfg = load_config(ROOT / config, [*base, *overrides])
    exp = build_experiment(cfg)
    algo = exp.algorithm
    algo.setup()
    steps: list[dict] = []
    probe = ProbeLoss(algo.step_loss(), steps)
    algo.step_loss = lambda: probe  # both the server's sigma steps and the clients' steps go through it
    original = algo.run_client_update

    def update(msg, data, state, ctx):
        probe.active, probe.round = data.client_id == client, ctx.round_idx
        try:
            return original(msg, data, state, ctx)
        finally:
            probe.active = False

    algo.run_client_update = update
    states: dict[int, dict] = {k: {} for k in range(cfg.train_args.client_num_in_total)}
    per_round = []
    t0 = time.perf_counter()
    for r in range(cfg.train_args.comm_round):
        sigma0, psi0 = dict(algo.sigma), dict(algo.psi)
        row = run_round(exp, r, states)
        gap = {n: algo.sigma[n] - psi0[n] for n in psi0}  # sigma the clients saw minus the psi they started from
        dpsi = {n: algo.psi[n] - psi0[n] for n in psi0}
        ev = evaluate(algo.global_model(), exp.dataset.test_images, exp.dataset.test_labels, exp.data_info, exp.device)
        mine = [s for s in steps if s["round"] == r + 1]  # rounds counted from 1, as per_round
        ratios = [s["pull_over_phi"] for s in mine if s["pull_over_phi"] is not None]
        per_round.append(
            {
                "round": r + 1,
                "test_acc": ev["acc"],
                "server_delta_sigma": flat_norm(algo.sigma, sigma0),
                "clients_delta_psi": flat_norm(algo.psi, psi0),
                "cos_delta_psi_with_sigma_minus_psi": cosine(dpsi, gap),
                "sigma_minus_psi_before": float(torch.sqrt(sum((g.double() ** 2).sum() for g in gap.values()))),
                "psi_density": row.get("psi_density"),
                "client_mask_rate": row.get("client_mask_rate"),
                "client_pseudo_acc": row.get("client_pseudo_acc"),
                "helpers_sent": row.get("helpers_sent"),
                "probed_steps": len(mine),
                "steps_with_phi_zero": sum(s["pull_over_phi"] is None for s in mine),
                "pull_over_phi_median": statistics.median(ratios) if ratios else None,
                "pull_over_phi_min": min(ratios, default=None),
                "pull_over_phi_max": max(ratios, default=None),
                "agree_grad_mean": statistics.fmean([s["agree_grad"] for s in mine]) if mine else None,
                "kl_grad_mean": statistics.fmean([s["kl_grad"] for s in mine]) if mine else None,
                "l2_grad_mean": statistics.fmean([s["l2_grad"] for s in mine]) if mine else None,
                "l1_grad_mean": statistics.fmean([s["l1_grad"] for s in mine]) if mine else None,
            }
        )
        ratio = per_round[-1]["pull_over_phi_median"]
        density = row.get("psi_density")
        print(
            f"{name} round {r + 1}: {100 * ev['acc']:.1f}%, pull/Phi median "
            f"{'-' if ratio is None else f'{ratio:.0f}'}, psi density {'-' if density is None else f'{density:.3f}'}",
            flush=True,
        )
    model = algo.global_model().eval()
    from fedml_ssfl.training import InputPipeline

    with torch.no_grad():
        x = InputPipeline(exp.data_info, exp.device).plain(exp.dataset.test_images)
        preds = model(x).argmax(dim=1).tolist()
    return {
        "name": name,
        "overrides": overrides,
        "final_acc": per_round[-1]["test_acc"],
        "rounds": per_round,
        "steps": steps,
        "predictions": preds,
        "wall_seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDE[,OVERRIDE...]")
    parser.add_argument("--rounds", type=int, default=None, help="comm_round (default: the config's 30)")
    parser.add_argument("--config", default="configs/mnist5k/fedmatch.yaml", help="a FedMatch config (from the root)")
    parser.add_argument("--client", type=int, default=0, help="the client whose psi steps are probed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="/tmp/fedml_ssfl_probe_fedmatch")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_fedmatch_phi.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    specs = args.variant or DEFAULT_VARIANTS
    results = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        overrides = [o for o in rest.split(",") if o]
        results.append(run_variant(name, args.config, overrides, args.rounds, args.client, args.seed, args.out_dir))
    first = results[0]["predictions"]
    for res in results:
        res["predictions_differing_from_first"] = sum(a != b for a, b in zip(res["predictions"], first)) / len(first)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()}, torch {torch.__version__}, 1 thread",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": args.config,
        "seed": args.seed,
        "probed_client": args.client,
    }
    out.write_text(json.dumps({**meta, "variants": results}, indent=1) + "\n")
    for res in results:
        share = 100 * res["predictions_differing_from_first"]
        print(f"{res['name']}: {100 * res['final_acc']:.1f}%, {share:.1f}% of test predictions differ from the first")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
