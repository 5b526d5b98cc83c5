"""Probe: how much does one round of training on each augmented view hurt a good model?

A cnn28-gn model is trained on 1,000 labeled MNIST-5k training images (weak view) to a good
test accuracy; then, from that same model, ``--steps`` SGD steps (lr ``--lr``, momentum 0.9,
batch 64, the true labels) are taken on each view of the remaining training images: the weak
view alpha(x), the strong view A(x) with the package's current settings, and A(x) with the
strong stage applied to every op (``op_prob 1``). The drop in test accuracy measures how far a
view moves the images out of the data distribution: a strong view that destroys the digit
destroys a model trained on it, whatever the algorithm. A steadier figure comes first: the good
model's own accuracy on each view of the test images (``acc on <view>``).

Writes ``benchmarks/results/probe_strong_view.json``.

Usage::

    python benchmarks/probe_strong_view.py            # seed 0
    python benchmarks/probe_strong_view.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl import seeding  # noqa: E402
from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.data.augment import normalize, strong_augment, to_float, weak_augment  # noqa: E402
from fedml_ssfl.experiment import build_experiment  # noqa: E402
from fedml_ssfl.metrics import evaluate  # noqa: E402
from fedml_ssfl.training import BatchStream  # noqa: E402


def views(info) -> dict:
    """The views to probe: name -> f(float images, generator)."""
    out = {
        "weak": lambda x, g: weak_augment(x, g, flip=info.flip),
        "strong (current)": lambda x, g: strong_augment(x, g, flip=info.flip),
    }
    if "op_prob" in inspect.signature(strong_augment).parameters:
        out["strong, every op applied (op_prob 1)"] = lambda x, g: strong_augment(x, g, flip=info.flip, op_prob=1.0)
    return out


def train(model, images, labels, idx, view, info, steps, lr, gen) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    stream = BatchStream(idx, 64, gen)
    model.train()
    for _ in range(steps):
        b = next(stream)
        x = normalize(view(to_float(images[b]), gen), info.mean, info.std)
        loss = nn.functional.cross_entropy(model(x), labels[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def probe(seed: int, steps: int, lr: float, pre_steps: int) -> dict:
    cfg = load_config(None, [f"common_args.random_seed={seed}", "model_args.norm=gn", "common_args.compare_with=[]"])
    exp = build_experiment(cfg)
    ds, info = exp.dataset, exp.data_info
    seeding.seed_everything(seed)
    model = exp.algorithm.model_fn()
    perm = torch.randperm(ds.train_labels.numel(), generator=seeding.generator(seed, "probe"))
    pre_idx, rest = perm[:1000], perm[1000:]
    train(
        model,
        ds.train_images,
        ds.train_labels,
        pre_idx,
        views(info)["weak"],
        info,
        pre_steps,
        0.03,
        seeding.generator(seed, "probe-pre"),
    )
    start = evaluate(model, ds.test_images, ds.test_labels, info, torch.device("cpu"))["acc"]
    row = {"seed": seed, "start_acc": start}
    model.eval()
    with torch.no_grad():  # the good model's accuracy on each view of the test images
        for name, view in views(info).items():
            g = seeding.generator(seed, "probe-view", name)
            x = normalize(view(to_float(ds.test_images), g), info.mean, info.std)
            row[f"acc on {name}"] = float((model(x).argmax(1) == ds.test_labels).float().mean())
    for name, view in views(info).items():
        m = copy.deepcopy(model)
        train(m, ds.train_images, ds.train_labels, rest, view, info, steps, lr, seeding.generator(seed, "probe", name))
        row[name] = evaluate(m, ds.test_images, ds.test_labels, info, torch.device("cpu"))["acc"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--pre-steps", type=int, default=600)
    ap.add_argument("--tag", default="", help="label stored with the rows (e.g. before / after a change)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_strong_view.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [probe(s, args.steps, args.lr, args.pre_steps) for s in args.seeds]
    for r in rows:
        print(json.dumps(r))
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    old[args.tag or "latest"] = {"steps": args.steps, "lr": args.lr, "pre_steps": args.pre_steps, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(old, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
