"""Probe: why Zhang et al.'s CRL from a bootstrapped model ends below server-only on MNIST-5k.

Builds ``w^0`` the way ``configs/mnist5k/fedavg_ssl_bootstrap.yaml`` does (``bootstrap_steps``
supervised steps on the server's 50 labels), then runs ONE client's T local steps from ``w^0`` on
its unlabeled data in several variants and records the test accuracy after every step:

* ``eq6``: CRL as Eq. 6 writes it: pseudo-label = argmax f(alpha(x); w_k) with the CURRENT local
  model, kept where max prob >= tau, cross-entropy on f(A(x)) (the package's client step);
* ``fixed_pl``: the same loss with the pseudo-labels and mask computed once by ``w^0`` (as SemiFL
  does), so the local model cannot feed its own drift back;
* ``correct_pl``: Eq. 6, but only the pseudo-labels that are right are kept (an oracle mask);
* ``true_labels``: cross-entropy on f(A(x)) with every sample's true label (no selection at all);
* ``self_training``: Eq. 3 (the loss on alpha(x)).

It also reports, at ``w^0``, the share of the client's samples that pass tau per true class.
Writes ``benchmarks/results/probe_crl_collapse.json``.

Usage::

    python benchmarks/probe_crl_collapse.py                 # seed 0, lr 0.03 (the config's)
    python benchmarks/probe_crl_collapse.py --lr 0.003 --tag lr0.003
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.experiment import build_experiment  # noqa: E402
from fedml_ssfl.metrics import evaluate  # noqa: E402
from fedml_ssfl.ssl import masked_consistency_loss  # noqa: E402
from fedml_ssfl.training import BatchStream, InputPipeline  # noqa: E402

VARIANTS = ("eq6", "fixed_pl", "correct_pl", "true_labels", "self_training")


def build(seed: int):
    cfg = load_config(
        ROOT / "configs" / "mnist5k" / "fedavg_ssl_bootstrap.yaml",
        [
            f"common_args.random_seed={seed}",
            "common_args.compare_with=[]",
            "tracking_args.progress_bar=false",
            "tracking_args.enable_tensorboard=false",
        ],
    )
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    exp.algorithm.bootstrap()  # w^0: bootstrap_steps supervised steps on the server's labels
    return cfg, exp


def client_steps(exp, variant: str, steps: int, lr: float, tau: float, client: int = 0) -> list[dict]:
    algo, ds = exp.algorithm, exp.dataset
    model = algo.global_model()
    w0 = copy.deepcopy(model)
    w0.eval()
    model = copy.deepcopy(model)
    model.train()
    pipe = InputPipeline(exp.data_info, exp.device)
    data = exp.client_data(client, 0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(1)
    stream = BatchStream(data.unlabeled_idx, exp.config.train_args.batch_size, gen)
    out = []
    for s in range(steps):
        b = next(stream)
        raw, truth = data.images[b], data.labels[b]
        weak, strong = pipe.weak(raw, gen), pipe.strong(raw, gen)
        if variant == "self_training":
            logits_train = logits_weak = model(weak)
        else:
            logits_weak, logits_train = model(torch.cat([weak, strong])).chunk(2)
        if variant == "fixed_pl":
            with torch.no_grad():
                logits_weak = w0(weak)
        loss, pl = masked_consistency_loss(logits_train, logits_weak.detach().softmax(dim=1), tau)
        kept = pl.mask
        if variant == "correct_pl":
            kept = pl.mask & (pl.labels == truth)
            loss = (F.cross_entropy(logits_train, pl.labels, reduction="none") * kept.float()).mean()
        elif variant == "true_labels":
            kept = torch.ones_like(pl.mask)
            loss = F.cross_entropy(logits_train, truth)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc = evaluate(model, ds.test_images, ds.test_labels, exp.data_info, exp.device)["acc"]
        n = int(kept.sum())
        out.append(
            {
                "step": s + 1,
                "test_acc": acc,
                "mask_rate": float(kept.float().mean()),
                "pseudo_acc": float((pl.labels[kept] == truth[kept]).float().mean()) if n else None,
            }
        )
    return out


def per_class_mask(exp, tau: float, client: int = 0) -> dict[str, float]:
    """Share of the client's samples whose w^0 prediction on the plain image passes tau, by true class."""
    data = exp.client_data(client, 0)
    pipe = InputPipeline(exp.data_info, exp.device)
    model = exp.algorithm.global_model()
    model.eval()
    with torch.no_grad():
        probs = model(pipe.plain(data.images[data.unlabeled_idx])).softmax(dim=1)
    passed = probs.max(dim=1).values >= tau
    truth = data.labels[data.unlabeled_idx]
    return {str(c): float(passed[truth == c].float().mean()) for c in range(data.num_classes) if (truth == c).any()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tag", default="lr0.03")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_crl_collapse.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg, exp = build(args.seed)
    tau = cfg.ssfl_args.threshold
    ds = exp.dataset
    w0_acc = evaluate(exp.algorithm.global_model(), ds.test_images, ds.test_labels, exp.data_info, exp.device)
    result = {
        "seed": args.seed,
        "lr": args.lr,
        "tau": tau,
        "bootstrap_steps": cfg.ssfl_args.bootstrap_steps,
        "w0_test_acc": w0_acc["acc"],
        "w0_mask_rate_by_class": per_class_mask(exp, tau),
        "variants": {v: client_steps(exp, v, args.steps, args.lr, tau) for v in VARIANTS},
    }
    for v, rows in result["variants"].items():
        print(f"{v:14s} " + " ".join(f"{r['test_acc']:.2f}" for r in rows), flush=True)
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[args.tag] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path} [{args.tag}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
