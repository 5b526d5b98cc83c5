"""Batched weak and strong augmentation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedml_ssfl.data import augment, normalize, strong_augment, to_float, weak_augment
from fedml_ssfl.data.augment import OP_NAMES, apply_op, default_cutout, sample_ops
from fedml_ssfl.seeding import generator


def batch(n: int, c: int, size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, size, size, generator=g)


def test_to_float_and_normalize() -> None:
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    f = to_float(x)
    assert f.dtype == torch.float32 and f.flatten().tolist() == pytest.approx([0.0, 0.2, 1.0])
    assert to_float(f) is f
    y = normalize(torch.ones(2, 3, 4, 4) * 0.5, (0.5, 0.25, 0.0), (0.5, 0.25, 1.0))
    assert y[:, 0].eq(0).all() and y[:, 1].eq(1).all() and y[:, 2].eq(0.5).all()


def test_weak_is_a_pure_shift() -> None:
    x = torch.arange(2 * 8 * 8, dtype=torch.float32).view(1, 2, 8, 8).div(128).repeat(16, 1, 1, 1)
    pad = 2
    out = weak_augment(x, generator(0, "weak"), flip=False, pad=pad)
    padded = F.pad(x[:1], (pad, pad, pad, pad), mode="reflect")[0]
    crops = {(i, j): padded[:, i : i + 8, j : j + 8] for i in range(2 * pad + 1) for j in range(2 * pad + 1)}
    offsets = set()
    for sample in out:
        match = [k for k, crop in crops.items() if torch.equal(sample, crop)]
        assert len(match) == 1
        offsets.add(match[0])
    assert len(offsets) > 3  # samples draw their own shifts


@pytest.mark.parametrize(
    ("shape", "pad"), [((7, 1, 28, 28), 3), ((6, 3, 5, 9), 2), ((5, 2, 4, 6), 4), ((3, 1, 3, 3), 5)]
)
def test_shift_crop_equals_padding_then_cropping(shape, pad) -> None:
    """The gather that never builds the padded image gives F.pad's crops exactly: reflect, and replicate
    where the pad is not below a side (both sides then, as F.pad would be called)."""
    from fedml_ssfl.data.augment import shift_crop

    n, _, h, w = shape
    x = torch.rand(shape, generator=torch.Generator().manual_seed(pad))
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=torch.Generator().manual_seed(h))
    offsets[0] = torch.tensor([0, 2 * pad])  # the corners of the range
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect" if pad < min(h, w) else "replicate")
    expected = torch.stack([padded[i, :, r : r + h, c : c + w] for i, (r, c) in enumerate(offsets.tolist())])
    assert torch.equal(shift_crop(x, pad, offsets), expected)
    assert torch.equal(shift_crop(x.to(memory_format=torch.channels_last), pad, offsets), expected)
    # one channel keeps the strides of the former crop (a permuted gather): the strong view's
    # sharpness conv2d rounds by the layout, so they keep the images of earlier versions
    assert shift_crop(x, pad, offsets).stride() == ((h * w, 1, w, 1) if shape[1] == 1 else expected.stride())


def test_the_warp_grid_is_affine_grids() -> None:
    """The element-wise grid gives F.affine_grid's coordinates (within float rounding: its batched
    matrix product may fuse the multiply-adds on another CPU), for rotations, shears, translations and
    arbitrary matrices, any size."""
    from fedml_ssfl.data.augment import _affine_grid, _warp_thetas

    gen = torch.Generator().manual_seed(0)
    ops = torch.tensor([OP_NAMES.index(n) for n in ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")] * 4)
    level, sign = torch.rand(len(ops), generator=gen), torch.where(torch.rand(len(ops), generator=gen) < 0.5, -1.0, 1.0)
    for theta in (_warp_thetas(ops, level, sign), torch.randn(9, 2, 3, generator=gen) * 3):
        for h, w in ((28, 28), (32, 32), (7, 13)):
            expected = F.affine_grid(theta, [len(theta), 1, h, w], align_corners=False)
            torch.testing.assert_close(_affine_grid(theta, h, w), expected, rtol=1e-6, atol=1e-6)


def test_the_warp_grid_is_the_former_element_wise_grid_bit_for_bit() -> None:
    """The grid built as (N, 2, H, W) and viewed as (N, H, W, 2) holds exactly the former stacked grid's
    values: the same products and sums in the same order."""
    from fedml_ssfl.data.augment import _affine_grid

    gen = torch.Generator().manual_seed(1)
    for theta in (torch.randn(11, 2, 3, generator=gen), torch.randn(1, 2, 3, generator=gen).double()):
        for h, w in ((28, 28), (7, 13)):
            base = F.affine_grid(torch.eye(2, 3, dtype=theta.dtype)[None], [1, 1, h, w], align_corners=False)
            xs, ys, t = base[..., 0], base[..., 1], theta.reshape(-1, 6, 1, 1)
            grid_x = (xs * t[:, 0]).add_(ys * t[:, 1]).add_(t[:, 2])
            grid_y = (xs * t[:, 3]).add_(ys * t[:, 4]).add_(t[:, 5])
            assert torch.equal(_affine_grid(theta, h, w), torch.stack([grid_x, grid_y], dim=-1))


@pytest.mark.parametrize("magnitude", [2, 10, 30])
def test_the_warp_table_holds_the_matrices_the_builder_gives(magnitude) -> None:
    """Each geometric op's looked-up matrix is the one _warp_thetas builds for that op, magnitude and
    sign in a batch of any size, at any position (the strong view looks its matrices up)."""
    from fedml_ssfl.data.augment import _warp_table, _warp_thetas

    table = _warp_table(magnitude)
    gen = torch.Generator().manual_seed(magnitude)
    names = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
    geometric = torch.tensor([OP_NAMES.index(n) for n in names])
    for n in (1, 7, 16, 33, 200):
        ops = geometric[torch.randint(0, 5, (n,), generator=gen)]
        mags = torch.randint(1, magnitude, (n,), generator=gen)
        signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        built = _warp_thetas(ops, mags.float() / 10.0, signs)
        assert torch.equal(table[ops, mags, (signs > 0).long()], built), n


def _former_theta(name, level, sign):
    """The per-op matrices built one op at a time, the oracle of the vectorised builder: rotation by
    sign 30 level degrees about the centre, shears by sign 0.3 level about the top-left corner (PIL),
    translations by sign 0.3 level of the side."""
    theta = torch.eye(2, 3).repeat(len(level), 1, 1)
    if name == "Rotate":
        angle = torch.deg2rad(sign * 30.0 * level)
        theta[:, 0, 0], theta[:, 0, 1] = torch.cos(angle), -torch.sin(angle)
        theta[:, 1, 0], theta[:, 1, 1] = torch.sin(angle), torch.cos(angle)
    elif name == "ShearX":  # PIL's (1, s, 0, 0, 1, 0): about the top-left corner
        theta[:, 0, 1] = theta[:, 0, 2] = sign * 0.3 * level
    elif name == "ShearY":
        theta[:, 1, 0] = theta[:, 1, 2] = sign * 0.3 * level
    elif name == "TranslateX":
        theta[:, 0, 2] = 2.0 * sign * 0.3 * level
    else:
        theta[:, 1, 2] = 2.0 * sign * 0.3 * level
    return theta


def test_the_warp_matrices_are_the_former_per_op_ones() -> None:
    """Rotation direction, which shear and which translation go where: each geometric op's matrix,
    built for a mixed batch, is bit for bit the one the former per-op builder gave."""
    from fedml_ssfl.data.augment import _warp_thetas

    names = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
    gen = torch.Generator().manual_seed(3)
    ops = torch.tensor([OP_NAMES.index(n) for n in names * 6])
    level = torch.randint(1, 10, (len(ops),), generator=gen).float() / 10
    sign = torch.where(torch.rand(len(ops), generator=gen) < 0.5, -1.0, 1.0)
    theta = _warp_thetas(ops, level, sign)
    for name in names:
        sel = ops == OP_NAMES.index(name)
        assert torch.equal(theta[sel], _former_theta(name, level[sel], sign[sel])), name


def test_weak_flip_false_never_flips() -> None:
    # pad 0: only flips could change the image
    x = batch(64, 3, 8)
    assert torch.equal(weak_augment(x, generator(1, "w"), flip=False, pad=0), x)
    flipped = weak_augment(x, generator(1, "w"), flip=True, pad=0)
    is_flipped = torch.tensor([torch.equal(a, b.flip(-1)) for a, b in zip(flipped, x)])
    unchanged = torch.tensor([torch.equal(a, b) for a, b in zip(flipped, x)])
    assert (is_flipped | unchanged).all() and is_flipped.any() and unchanged.any()


def test_weak_default_pad_shapes() -> None:
    for shape in ((5, 1, 28, 28), (5, 3, 32, 32)):
        out = weak_augment(torch.rand(shape), generator(0), flip=True)
        assert out.shape == shape and out.min() >= 0 and out.max() <= 1


@pytest.mark.parametrize("shape", [(32, 1, 28, 28), (32, 3, 32, 32)])
def test_strong_shapes_range_determinism(shape: tuple[int, int, int, int]) -> None:
    x = torch.rand(shape)
    a, ops_a = strong_augment(x, generator(5, "s"), flip=True, return_ops=True)
    b, ops_b = strong_augment(x, generator(5, "s"), flip=True, return_ops=True)
    c = strong_augment(x, generator(6, "s"), flip=True)
    assert a.shape == shape and a.dtype == torch.float32
    assert a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, b) and torch.equal(ops_a, ops_b)
    assert not torch.equal(a, c)
    assert ops_a.shape == (shape[0], 2) and ops_a.dtype == torch.int64


def test_strong_per_sample_ops() -> None:
    x = batch(1, 3, 32).repeat(48, 1, 1, 1)
    out, ops = strong_augment(x, generator(2, "s"), flip=False, return_ops=True)
    assert len({tuple(r) for r in ops.tolist()}) > 10
    assert -1 <= int(ops.min()) and int(ops.max()) < len(OP_NAMES)
    distinct = torch.unique(out.flatten(1), dim=0)
    assert len(distinct) > 40


def test_strong_uint8_input_via_to_float_and_no_cutout() -> None:
    x = (batch(8, 1, 28) * 255).to(torch.uint8)
    out = strong_augment(to_float(x), generator(0), flip=False, cutout=0, num_ops=1, magnitude=5)
    assert out.shape == (8, 1, 28, 28) and 0 <= out.min() and out.max() <= 1


@pytest.mark.parametrize("op_id", range(len(OP_NAMES)))
@pytest.mark.parametrize("channels", [1, 3])
def test_every_op_runs(op_id: int, channels: int) -> None:
    x = batch(4, channels, 16, seed=op_id)
    level = torch.tensor([0.1, 0.5, 0.9, 1.0])
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = apply_op(x.clone(), op_id, level, sign)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    if OP_NAMES[op_id] not in ("Identity", "Color") or channels == 3:
        if OP_NAMES[op_id] == "Identity":
            assert torch.equal(out, x)
        else:
            assert not torch.allclose(out, x)


def test_brightness_and_color_are_pils_blends() -> None:
    # PIL's ImageEnhance: Brightness blends with a black image (f x), Color with the image's grey, which
    # for one channel is the image itself (no change); f = 0.05 + 0.9 level (RandAugmentMC's max_v 0.9)
    level, sign = torch.tensor([0.1, 0.5, 0.9, 1.0]), torch.tensor([1.0, -1.0, 1.0, -1.0])
    factor = (0.05 + 0.9 * level).view(-1, 1, 1, 1)
    for channels in (1, 3):
        x = batch(4, channels, 16, seed=channels)
        assert torch.equal(apply_op(x.clone(), OP_NAMES.index("Brightness"), level, sign), factor * x)
    grey = batch(4, 1, 16, seed=5)
    assert torch.equal(apply_op(grey.clone(), OP_NAMES.index("Color"), level, sign), grey)


def test_cutout_is_one_fixed_grey_square_clipped_only_at_the_far_border() -> None:
    # RandAugmentMC's CutoutAbs(v): 16 at 32x32, 7 at 28x28; PIL's rectangle includes both corners,
    # so the square is v + 1 pixels a side; the corner is moved inside the image, so only the far
    # border can clip it
    assert default_cutout(32) == 16 and default_cutout(28) == 7
    for size, side in ((32, 17), (28, 8)):
        x = torch.zeros(64, 1, size, size)
        out = strong_augment(x, generator(3), flip=False, num_ops=0)
        grey = out == 127.0 / 255.0
        assert (grey.sum(dim=(1, 2, 3)) > 0).all() and (grey.sum(dim=(1, 2, 3)) <= side * side).all()
        rows, cols = grey.any(dim=3).squeeze(1), grey.any(dim=2).squeeze(1)
        heights, widths = rows.sum(1), cols.sum(1)
        first_row = rows.float().argmax(1)
        # a square that does not touch the bottom edge is full height
        inside = first_row + side <= size
        assert (heights[inside] == side).all() and (widths.max() == side)
        assert (heights >= 1).all()


@pytest.mark.parametrize(("h", "w", "side"), [(28, 28, 7), (32, 32, 16), (5, 9, 3), (8, 8, 20), (40, 40, 10)])
def test_the_cutout_table_gives_apply_cutouts_squares(h, w, side) -> None:
    """The strong view looks its cutout masks up (images up to 32x32): every centre's square is
    apply_cutout's, values and strides (40x40 takes apply_cutout itself)."""
    from fedml_ssfl.data.augment import _cutout_squares, apply_cutout

    centres = torch.cartesian_prod(torch.arange(h), torch.arange(w))
    x = torch.rand(len(centres), 1, h, w, generator=torch.Generator().manual_seed(h))
    for images in (x, x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)):
        sides = torch.full((len(centres),), side)
        expected = apply_cutout(images, sides, centres)
        got = _cutout_squares(images, side, centres)
        assert torch.equal(got, expected) and got.stride() == expected.stride()


def test_magnitudes_are_integers_below_m_and_each_op_is_applied_half_the_time() -> None:
    # RandAugmentMC: v = randint(1, m), i.e. 1..m-1, and each drawn op applies with probability 0.5
    ops, levels, signs, applied = sample_ops(20_000, generator(0, "mc"), num_ops=2, magnitude=10)
    mags = levels * 10
    assert torch.allclose(mags, mags.round()) and mags.min() == 1 and mags.max() == 9
    assert abs(float(applied.float().mean()) - 0.5) < 0.02
    assert set(ops.unique().tolist()) == set(range(len(OP_NAMES)))
    _, _, _, always = sample_ops(100, generator(0, "mc"), op_prob=1.0)
    assert always.all()


def test_op_prob_zero_leaves_only_the_weak_view_and_the_cutout() -> None:
    x = batch(32, 1, 28)
    out, ops = strong_augment(x, generator(4), flip=False, op_prob=0.0, cutout=0, return_ops=True)
    assert (ops == -1).all()
    assert torch.equal(out, weak_augment(x, generator(4), flip=False).clamp(0, 1))


def test_the_default_strong_view_is_randaugment_mc() -> None:
    # defaults: 2 ops, each applied half the time (a quarter of the samples get no op at all),
    # magnitudes 1..9, and CutoutAbs(7) at 28x28: PIL's inclusive rectangle fills 8 x 8 pixels
    x = torch.zeros(4000, 1, 28, 28)
    out, ops = strong_augment(x, generator(6), flip=False, return_ops=True)
    applied = ops >= 0
    assert abs(float(applied.float().mean()) - 0.5) < 0.03
    assert abs(float((~applied).all(dim=1).float().mean()) - 0.25) < 0.03
    grey = (out == 127.0 / 255.0).sum(dim=(1, 2, 3))
    assert int(grey.max()) == 8 * 8


# ---- the batched fast path gives the op-by-op path's images bit for bit (issue 15) -----------------
def _strong_op_by_op(x, gen, *, flip, num_ops=2, magnitude=10, op_prob=0.5, cutout=None):
    """The former strong_augment: each op applied to its samples (boolean mask), one op at a time,
    geometric ops each with their own warp. The fast path must give exactly these images."""
    from fedml_ssfl.data.augment import _sample_cutout, apply_cutout

    n, _, h, w = x.shape
    x = weak_augment(x, gen, flip=flip)
    ops, levels, signs, applied = sample_ops(n, gen, num_ops, magnitude, op_prob)
    side = default_cutout(h) if cutout is None else cutout
    sides, centres = _sample_cutout(n, h, w, side, gen)
    x = x.clone()
    for slot in range(num_ops):
        for op_id in torch.unique(ops[:, slot]).tolist():
            sel = (ops[:, slot] == op_id) & applied[:, slot]
            if OP_NAMES[op_id] == "Identity" or not bool(sel.any()):
                continue
            x[sel] = apply_op(x[sel], op_id, levels[sel, slot], signs[sel, slot])
    return apply_cutout(x, sides, centres).clamp_(0.0, 1.0) if side > 0 else x.clamp_(0.0, 1.0)


@pytest.mark.parametrize(
    ("shape", "flip", "options"),
    [
        ((64, 1, 28, 28), False, {}),
        ((64, 1, 28, 28), False, {"num_ops": 3, "op_prob": 1.0}),
        ((37, 3, 32, 32), True, {}),
        ((5, 1, 8, 8), False, {"magnitude": 5, "cutout": 0}),
    ],
)
@pytest.mark.parametrize("kind", ["float32", "channels_last", "float64"])
def test_strong_fast_path_equals_the_op_by_op_path(shape, flip, options, kind) -> None:
    for seed in range(6):
        x = (batch(shape[0], shape[1], shape[2], seed) * 255).round() / 255
        x[:, :, :3, :3] = 0.5  # flat patches: ties for equalize and autocontrast
        x = (
            x.double()
            if kind == "float64"
            else x.contiguous(memory_format=torch.channels_last)
            if kind != "float32"
            else x
        )
        fast = strong_augment(x, generator(seed, "s"), flip=flip, **options)
        slow = _strong_op_by_op(x, generator(seed, "s"), flip=flip, **options)
        assert torch.equal(fast, slow), (seed, (fast - slow).abs().max())
        assert fast.dtype == slow.dtype and fast.stride() == slow.stride(), seed


def test_strong_fast_path_follows_the_default_dtype() -> None:
    """Under a float64 default dtype the signs sample_ops draws are float64, and so are the geometric
    matrices the op-by-op path builds from them: the looked-up ones must be those."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        x = (batch(64, 3, 32, seed=5) * 255).round().float() / 255
        fast = strong_augment(x, generator(5, "s"), flip=True, num_ops=3, op_prob=1.0)
        slow = _strong_op_by_op(x, generator(5, "s"), flip=True, num_ops=3, op_prob=1.0)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(fast, slow)


def test_equalize_histogram_equals_the_sorted_cdf(monkeypatch) -> None:
    """Both ways of counting (the CPU's histogram, the sorted rows used on a GPU) equal the counts
    written out, and equalize gives the same images whichever it uses."""
    x = (batch(9, 3, 16, seed=3) * 255).round() / 255
    x[0] = 0.25  # a single-valued image is left unchanged
    x[1, :, :8] = 0.0
    q = (x * 255).round().reshape(27, -1)
    at_or_below = (q.unsqueeze(1) <= q.unsqueeze(2)).sum(dim=2)  # [row, pixel]: pixels at or below its level
    lowest = (q <= q.amin(dim=1, keepdim=True)).sum(dim=1, keepdim=True)
    for counts in (augment._cdf_by_histogram, augment._cdf_by_sorting):
        cdf, cdf_min = counts(q.clone())
        assert torch.equal(cdf, at_or_below) and torch.equal(cdf_min, lowest), counts.__name__
    out = apply_op(x.clone(), OP_NAMES.index("Equalize"), torch.ones(9), torch.ones(9))
    monkeypatch.setattr(augment, "_cdf_by_histogram", augment._cdf_by_sorting)  # the GPU's way, on the CPU
    assert torch.equal(apply_op(x.clone(), OP_NAMES.index("Equalize"), torch.ones(9), torch.ones(9)), out)
    assert torch.equal(out[0], x[0])


def test_the_gpu_parity_script_runs_on_the_cpu(tmp_path) -> None:
    """benchmarks/gpu_augment_check.py, run here with --device cpu: the code a GPU machine runs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_augment_check.py"
    out = tmp_path / "check.json"
    args = [sys.executable, str(script), "--device", "cpu", "--batch", "4", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["view"]) for r in rows] == [
        ([4, c, s, s], v) for c, s in ((1, 28), (3, 32)) for v in ("weak", "strong")
    ]
    assert all(r["max_abs_diff"] == 0.0 and r["ms_per_call"] > 0 for r in rows)


@pytest.mark.parametrize("name", ["ShearX", "ShearY"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_shears_are_pils_about_the_top_left_corner(name, sign) -> None:
    """PIL's ShearX, ``transform(AFFINE, (1, s, 0, 0, 1, 0))``, reads output pixel (x, y) (centres at
    ``i + 0.5`` from the corner) from input ``(x + s y, y)``: the top row hardly moves, the bottom one
    by ``s H``. Checked against a bilinear reading of that formula written out here (zeros outside)."""
    h = w = 12
    x = torch.rand(1, 1, h, w, generator=torch.Generator().manual_seed(7))
    level, s = torch.tensor([1.0]), 0.3 * sign
    out = apply_op(x.clone(), OP_NAMES.index(name), level, torch.tensor([sign]))[0, 0]
    img = x[0, 0] if name == "ShearX" else x[0, 0].T  # ShearY is ShearX of the transposed image
    expected = torch.zeros(h, w)
    for i in range(h):
        for j in range(w):
            src = (j + 0.5) + s * (i + 0.5) - 0.5  # input column, in pixel-index units
            lo = math.floor(src)
            frac = src - lo
            left = img[i, lo] if 0 <= lo < w else 0.0
            right = img[i, lo + 1] if 0 <= lo + 1 < w else 0.0
            expected[i, j] = (1 - frac) * left + frac * right
    if name == "ShearY":
        expected = expected.T
    assert torch.allclose(out, expected.clamp(0, 1), atol=1e-5)
