"""Edge throughput: images per second for torch eager, ONNX float and ONNX int8, plus file sizes.

For each model (default: the small CNN on MNIST-5k shapes and ResNet-18 with GroupNorm and with
BatchNorm on 3x32x32) the script

1. fits the model briefly on shipped data (MNIST-5k for cnn28, the synthetic 3x32x32 set for
   ResNet-18), so the int8 gates are measured on a model with real decision margins;
2. exports it with :func:`mobile_export.export.export_model` exactly as ``fedml-ssfl export``
   does (parity, ORT format, int8 with its gates enforced);
3. times the whole edge job (uint8 images in -> probs, label, confidence, mask out) for torch
   eager (the same wrapper in ``torch.inference_mode``), onnxruntime on ``model.onnx`` and on
   ``model.int8.onnx``, interleaving the backends over several rounds and keeping each one's
   best round (the machine is shared; the best round is the least disturbed one).

Figures go to ``benchmarks/results/edge_throughput.json`` (and a Markdown table to stdout and
``.md`` beside it). Run: ``python benchmarks/edge_throughput.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.data import load_dataset, normalize, to_float  # noqa: E402
from fedml_ssfl.models import build_model, count_parameters  # noqa: E402
from mobile_export.export import EdgeMetadata, EdgeModel, export_model  # noqa: E402
from mobile_export.verify import make_session  # noqa: E402

CASES = {
    "cnn28-gn": ("cnn28", "gn", "mnist5k"),
    "resnet18-gn": ("resnet18", "gn", "synthetic"),
    "resnet18-bn": ("resnet18", "bn", "synthetic"),
}


def fit(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, steps: int, batch: int = 64) -> None:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net.train()
    for _ in range(steps):
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        loss = nn.functional.cross_entropy(net(normalize(to_float(images[idx]), mean, std)), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()


def time_backends(fns: dict, batch: np.ndarray, rounds: int, seconds: float) -> dict[str, dict[str, float]]:
    """Interleave the backends; per backend keep every round's images/s, report best and median."""
    per: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn(batch)
        fn(batch)
    for _ in range(rounds):
        for name, fn in fns.items():
            n, t0 = 0, time.perf_counter()
            while True:
                fn(batch)
                n += 1
                dt = time.perf_counter() - t0
                if dt >= seconds and n >= 2:
                    break
            per[name].append(n * len(batch) / dt)
    return {name: {"best": max(v), "median": float(np.median(v)), "rounds": v} for name, v in per.items()}


def bench_case(key: str, args, workdir: Path) -> dict:
    name, norm, dataset = CASES[key]
    torch.manual_seed(0)
    options = {"shape": (3, 32, 32), "num_samples": 3000} if dataset == "synthetic" else {}
    ds = load_dataset(dataset, seed=0, **options)
    net = build_model(name, num_classes=ds.num_classes, in_channels=ds.in_channels, image_size=ds.image_size, norm=norm)
    steps = args.fit_steps_small if name == "cnn28" else args.fit_steps_resnet
    t = time.perf_counter()
    fit(net, ds.train_images, ds.train_labels, ds.mean, ds.std, steps)
    fit_s = time.perf_counter() - t
    meta = EdgeMetadata(
        class_names=list(ds.class_names),
        mean=list(ds.mean),
        std=list(ds.std),
        in_channels=ds.in_channels,
        image_size=ds.image_size,
        thresholds=[0.95],
        model=name,
        norm=norm,
        dataset=dataset,
        algorithm="benchmark",
        round=0,
        config_hash="bench",
    )
    out = workdir / key
    n_test = min(1000, len(ds.test_images))
    train = ds.train_images.numpy()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(train))
    report = export_model(
        net,
        out,
        meta,
        test_images=ds.test_images[:n_test].numpy(),
        test_labels=ds.test_labels[:n_test].numpy(),
        calibration_images=train[order[:256]],
        unlabeled_images=train[order[256:1256]],
    )
    edge = EdgeModel(net, ds.mean, ds.std).eval()
    thr = torch.full((ds.num_classes,), 0.95)
    sessions = {
        k: make_session(out / f, threads=args.threads)
        for k, f in (("onnx_float", "model.onnx"), ("onnx_int8", "model.int8.onnx"))
    }

    def torch_fn(x):
        with torch.inference_mode():
            return edge(torch.from_numpy(x), thr)

    fns = {"torch_eager": torch_fn}
    for k, sess in sessions.items():
        fns[k] = lambda x, s=sess: s.run(None, {"images": x})  # the thresholds are a constant of the graph
    batch = np.ascontiguousarray(ds.test_images[: args.batch_size].numpy())
    if len(batch) < args.batch_size:
        batch = np.resize(batch, (args.batch_size, *batch.shape[1:]))
    speed = time_backends(fns, batch, args.rounds, args.seconds)
    with tempfile.NamedTemporaryFile(suffix=".pt") as fh:
        torch.save(net.state_dict(), fh.name)
        torch_bytes = os.path.getsize(fh.name)
    sizes = {k: v["bytes"] for k, v in report.artifacts.items() if isinstance(v, dict)}
    sizes["torch_state_dict"] = torch_bytes
    gates = report.checks["int8_gates"]
    return {
        "model": name,
        "norm": norm,
        "dataset": dataset,
        "params": count_parameters(net),
        "input": [ds.in_channels, ds.image_size, ds.image_size],
        "batch_size": args.batch_size,
        "fit_steps": steps,
        "fit_seconds": fit_s,
        "export_seconds": report.seconds,
        "images_per_second": speed,
        "bytes": sizes,
        "int8_to_float_size_onnx": sizes["int8_onnx"] / sizes["onnx"],
        "int8_to_float_size_ort": sizes["int8_ort"] / sizes["ort"],
        "onnx_float_vs_torch": speed["onnx_float"]["best"] / speed["torch_eager"]["best"],
        "int8_vs_onnx_float": speed["onnx_int8"]["best"] / speed["onnx_float"]["best"],
        "parity_max_abs_prob_diff": report.checks["parity_onnx"]["max_abs_prob_diff"],
        "int8_gates": {
            k: gates[k]
            for k in (
                "float_test_acc",
                "int8_test_acc",
                "test_acc_drop_points",
                "label_agreement",
                "float_mask_rate",
                "int8_mask_rate",
                "mask_rate_change_points",
            )
            if k in gates
        },
    }


def markdown(results: list[dict], machine: str) -> str:
    lines = [
        f"Edge throughput, {machine}; images/s, best of the interleaved rounds (median in brackets).",
        "",
        "| model | torch eager | ONNX float | ONNX int8 | float/torch | int8/float | float .onnx | "
        "int8 .onnx | int8/float size | int8 acc drop | agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["images_per_second"]
        g = r["int8_gates"]
        lines.append(
            f"| {r['model']}-{r['norm']} {'x'.join(map(str, r['input']))} b{r['batch_size']} "
            f"| {s['torch_eager']['best']:.0f} ({s['torch_eager']['median']:.0f}) "
            f"| {s['onnx_float']['best']:.0f} ({s['onnx_float']['median']:.0f}) "
            f"| {s['onnx_int8']['best']:.0f} ({s['onnx_int8']['median']:.0f}) "
            f"| {r['onnx_float_vs_torch']:.2f}x | {r['int8_vs_onnx_float']:.2f}x "
            f"| {r['bytes']['onnx'] / 2**20:.2f} MiB | {r['bytes']['int8_onnx'] / 2**20:.2f} MiB "
            f"| {r['int8_to_float_size_onnx']:.4f} | {g['test_acc_drop_points']:+.2f} pt "
            f"| {100 * g['label_agreement']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per backend")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per backend per round")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for torch and onnxruntime")
    p.add_argument("--fit-steps-small", type=int, default=300)
    p.add_argument("--fit-steps-resnet", type=int, default=60)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "edge_throughput.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} threads"
    results = []
    with tempfile.TemporaryDirectory(prefix="edge_bench_") as tmp:
        for key in args.models:
            t = time.perf_counter()
            results.append(bench_case(key, args, Path(tmp)))
            print(f"{key}: done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    table = markdown(results, machine)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "torch": torch.__version__, "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nfigures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
