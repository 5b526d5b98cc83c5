"""Batched image augmentation on CPU or GPU: weak (flip + pad-and-crop shift) and strong (RandAugment).

Inputs are float tensors ``(N, C, H, W)`` in ``[0, 1]`` (see :func:`to_float`), with 1 or 3
channels. Every sample draws its own random operations and parameters. All random numbers are
drawn on the CPU from the ``torch.Generator`` passed in, then moved to the input's device, so the
same generator state gives the same output on any device (up to floating-point differences of
the device's kernels).

Strong augmentation follows FixMatch's RandAugmentMC (``fixmatch_augment_pool``), the strong view
of the SSFL benchmark authors' code (docs/algorithms.md): weak augmentation, then ``num_ops`` ops
per sample drawn from :data:`OP_NAMES` with replacement, each applied with probability ``op_prob``
(0.5) at an integer magnitude ``v`` uniform in ``[1, magnitude)`` (numpy's ``randint(1, m)``: 1..9
of 10), then a grey cutout square (``CutoutAbs`` of 16 px at 32x32, 7 px at 28x28). As
RandAugmentMC does it:

* Brightness, Color, Contrast and Sharpness blend with the factor ``0.05 + 0.9 v / 10`` (its
  ``max_v = 0.9, bias = 0.05``; 0.14 to 0.86);
* ShearX / ShearY are PIL's affine ``(1, s, 0, 0, 1, 0)`` / ``(1, 0, 0, s, 1, 0)``: the shear is
  about the image's top-left corner (pixel coordinates from the corner), not its centre;
  Rotate turns about the centre and TranslateX / Y shift by ``0.3 v / 10`` of the side;
* the cutout is PIL's ``ImageDraw.rectangle((x0, y0, x0 + v, y0 + v))``, whose corners are both
  inclusive: a square of ``v + 1`` pixels a side (17 at 32x32, 8 at 28x28), clipped at the far
  border.

Deviations from RandAugmentMC (PIL on one image at a time), all small:

* ops run on float tensors, batched; Equalize approximates PIL's table (see :func:`_equalize`);
* geometric ops sample bilinearly (PIL: nearest) and fill with black like PIL's defaults; the
  corner shear assumes square images (every dataset here; on an H x W image PIL's shift is
  ``s H / W`` of the half-width);
* the cutout's corner is ``max(0, c - v // 2)`` for an integer centre c uniform over the rows
  (columns); PIL's is ``int(max(0, u - v / 2))`` for a float u uniform in ``[0, H)``: the same
  distribution for even v, for odd v the first and last corners differ by half a pixel's share.

Other strong views. FedMatch's authors make theirs with their own RandAugment at a random
magnitude in [2, 5] and no cutout (Jeong et al. A.1), SemiFL's authors with a different pool
(Invert and a 40 px CutoutConst among the ops, enhancement ``0.1 + 1.8 m / 10`` at the fixed
m = 10, each op applied with a probability drawn from U(0.2, 0.8)). Neither is implemented: every
algorithm here takes this RandAugmentMC view, which is stronger than FedMatch's (declared in
:mod:`fedml_ssfl.algorithms.fedmatch` and :mod:`fedml_ssfl.algorithms.fedssl_baselines`) and
differs from SemiFL's (declared in :mod:`fedml_ssfl.algorithms.semifl`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

OP_NAMES: tuple[str, ...] = (
    "Identity",
    "AutoContrast",
    "Brightness",
    "Color",
    "Contrast",
    "Equalize",
    "Posterize",
    "Rotate",
    "Sharpness",
    "ShearX",
    "ShearY",
    "Solarize",
    "TranslateX",
    "TranslateY",
)
"""RandAugment operations; an op id is an index into this tuple."""

_MAX_LEVEL = 10.0
_MAX_ROTATE_DEG = 30.0
_MAX_SHEAR = 0.3
_MAX_TRANSLATE = 0.3  # fraction of the image size
_ENHANCE_MAX, _ENHANCE_BIAS = 0.9, 0.05  # fixmatch_augment_pool: factor 0.05 + 0.9 v / 10, in [0.14, 0.86]
_GREY = 127.0 / 255.0  # RandAugmentMC's cutout colour (127, 127, 127)
_FILL = 0.0  # what PIL's rotate / affine transform put outside the image


def to_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 images to float32 in ``[0, 1]``; floating-point input passes through unchanged.

    Parameters
    ----------
    x : torch.Tensor
        uint8 or floating-point images.

    Returns
    -------
    torch.Tensor
        Floating-point images.
    """
    if x.is_floating_point():
        return x
    if x.dtype != torch.uint8:
        raise TypeError(f"to_float expects uint8 or floating-point images, got {x.dtype}")
    return x.to(torch.float32).div_(255.0)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel ``(x - mean) / std``.

    Parameters
    ----------
    x : torch.Tensor
        Float images ``(N, C, H, W)``.
    mean, std : sequence of float
        One value per channel.

    Returns
    -------
    torch.Tensor
        Normalised images (a new tensor).
    """
    return (x - _channel_values(tuple(mean), x.dtype, x.device)) / _channel_values(tuple(std), x.dtype, x.device)


@lru_cache(maxsize=32)
def _channel_values(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``(1, C, 1, 1)`` tensor, made once per dtype and device (read only)."""
    return torch.as_tensor(values, dtype=dtype, device=device).view(1, -1, 1, 1)


# --------------------------------------------------------------------------------------------
# weak augmentation
# --------------------------------------------------------------------------------------------


def random_flip(x: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """Mirror horizontally the samples where the boolean ``flips`` (N,) is True."""
    return torch.where(flips.to(x.device).view(-1, 1, 1, 1), x.flip(-1), x)


def shift_crop(x: torch.Tensor, pad: int, offsets: torch.Tensor) -> torch.Tensor:
    """Reflect-pad by ``pad`` and crop each sample back to ``H x W`` at its own offset.

    Parameters
    ----------
    x : torch.Tensor
        ``(N, C, H, W)``.
    pad : int
        Padding on each side.
    offsets : torch.Tensor
        int64 ``(N, 2)``: the (row, column) of each crop's top-left corner in the padded image,
        each in ``[0, 2 pad]``.

    Returns
    -------
    torch.Tensor
        The cropped batch; ``offsets == pad`` returns the input.
    """
    if pad == 0:
        return x
    n, c, h, w = x.shape
    # the padded image is never built: each output pixel reads the input pixel the padding would have
    # put there (a pure copy, so exactly the padded-and-cropped values), one gather for the batch
    offsets = offsets.to(x.device)
    reflect = pad < min(h, w)  # reflect padding is undefined for a pad as wide as a side: replicate
    rows = _crop_sources(h, pad, reflect, x.device)[offsets[:, 0]]  # (N, H) input rows
    cols = _crop_sources(w, pad, reflect, x.device)[offsets[:, 1]]  # (N, W) input columns
    flat = (rows[:, :, None] * w + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    out = torch.gather(x.reshape(n, c, h * w), 2, flat)
    if c == 1:
        # the strides the former pad-and-index crop left on one channel, (HW, 1, W, 1): PyTorch reads
        # them as channels_last, and the sharpness blur's conv2d rounds by the layout, so this keeps
        # the strong view's images bit for bit
        return out.view(n, h, w, 1).permute(0, 3, 1, 2)
    return out.view(n, c, h, w)


@lru_cache(maxsize=32)
def _crop_sources(size: int, pad: int, reflect: bool, device: torch.device) -> torch.Tensor:
    """``(2 pad + 1, size)``: for each crop offset into a side padded by ``pad``, the input position
    each output position copies, with ``F.pad``'s "reflect" (the edge pixel not repeated) or
    "replicate". Made once per side, pad and device; read only."""
    at = torch.arange(-pad, size + pad, device=device)
    if reflect:
        source = torch.where(at < 0, -at, torch.where(at >= size, 2 * (size - 1) - at, at))
    else:
        source = at.clamp(0, size - 1)
    return source.unfold(0, size, 1).contiguous()


def weak_augment(x: torch.Tensor, generator: torch.Generator, *, flip: bool, pad: int | None = None) -> torch.Tensor:
    """Weak augmentation alpha(): random horizontal flip then a random pad-and-crop shift.

    Parameters
    ----------
    x : torch.Tensor
        Float images ``(N, C, H, W)`` in ``[0, 1]``, on any device.
    generator : torch.Generator
        CPU generator all random draws come from.
    flip : bool
        Flip each sample with probability 0.5 (use False for digits and letters).
    pad : int, optional
        Shift range in pixels; default ``H // 8`` (4 at 32x32, 3 at 28x28). Reflect padding.

    Returns
    -------
    torch.Tensor
        Augmented images, same shape and device.
    """
    n, _, h, _ = x.shape
    pad = h // 8 if pad is None else int(pad)
    flips = torch.rand(n, generator=generator) < 0.5  # drawn always: flip=False keeps the stream aligned
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator)
    if flip:
        x = random_flip(x, flips)
    return shift_crop(x, pad, offsets)


# --------------------------------------------------------------------------------------------
# RandAugment operations: f(x_subset, level (M,), sign (M,)) with level in [0.1, 1], sign +-1
# --------------------------------------------------------------------------------------------


def _per_sample(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _grey(x: torch.Tensor) -> torch.Tensor:
    """Luminance ``(M, 1, H, W)`` (ITU-R 601 weights for RGB; the image itself for 1 channel)."""
    if x.shape[1] == 1:
        return x
    w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * w).sum(dim=1, keepdim=True)


def _blend(x: torch.Tensor, base: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL ImageEnhance: ``base + factor (x - base)``."""
    return base + _per_sample(factor) * (x - base)


def _enhance_factor(level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """RandAugmentMC's enhancement factor ``0.05 + 0.9 level`` (no direction: always below 1)."""
    return _ENHANCE_BIAS + _ENHANCE_MAX * level


def _identity(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    return x


def _autocontrast(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    span = hi - lo
    stretched = (x - lo) / span.clamp_min(1e-6)
    return torch.where(span > 1e-6, stretched, x)


def _brightness(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    # _blend with a black base, 0 + f (x - 0), is f x: the same values in one multiplication
    return _per_sample(_enhance_factor(level, sign)) * x


def _color(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    return _blend(x, _grey(x), _enhance_factor(level, sign))


def _contrast(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    mean = _grey(x).mean(dim=(1, 2, 3), keepdim=True)
    return _blend(x, mean, _enhance_factor(level, sign))


def _cdf_by_histogram(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of grey levels ``q`` (floats 0..255): per pixel, how many of its row's pixels are at or
    below its level, and per row the same count for the row's lowest level (int64). From a 256-bin
    histogram per row: the CPU's way."""
    levels = q.long()
    rows = torch.arange(q.shape[0]).view(-1, 1) * 256
    table = torch.bincount((levels + rows).view(-1), minlength=q.shape[0] * 256).view(q.shape[0], 256).cumsum_(dim=1)
    return table.gather(1, levels), table.gather(1, levels.amin(dim=1, keepdim=True))


def _cdf_by_sorting(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts of :func:`_cdf_by_histogram` from the sorted rows with ``searchsorted``: the way on other
    devices (deterministic on a GPU, unlike scatter-based histograms)."""
    ordered, _ = torch.sort(q, dim=1)
    return (
        torch.searchsorted(ordered, q, right=True),
        torch.searchsorted(ordered, ordered[:, :1].contiguous(), right=True),
    )


def _equalize(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """Histogram equalisation per sample and channel of the 8-bit quantised image.

    Approximation of PIL's ``ImageOps.equalize``: each grey level v maps to the normalised CDF
    ``(cdf(v) - cdf_min) / (total - cdf_min)`` rather than PIL's step-based table. The CDF counts
    (integers, so both ways give the same numbers) come from :func:`_cdf_by_histogram` on the CPU
    and :func:`_cdf_by_sorting` elsewhere. A single-valued channel is left unchanged.
    """
    m, c, h, w = x.shape
    q = (x * 255.0).round().clamp_(0.0, 255.0).reshape(m * c, h * w).contiguous()
    counts = _cdf_by_histogram if x.device.type == "cpu" else _cdf_by_sorting
    cdf, cdf_min = (t.to(x.dtype) for t in counts(q))
    span = h * w - cdf_min
    out = ((cdf - cdf_min) / span.clamp_min(1.0)).view(m, c, h, w)
    return torch.where(span.view(m, c, 1, 1) > 0, out, x)


def _posterize(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """RandAugmentMC: keep ``4 + int(4 level)`` bits (4 bits at magnitude 1-2, 7 at 8-9)."""
    bits = 4 + torch.floor(level * 4.0 + 1e-6).long()
    shift = _per_sample(8 - bits)
    q = (x * 255.0).round().long()
    return ((q >> shift) << shift).to(x.dtype) / 255.0


def _solarize(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    threshold = _per_sample(1.0 - level)
    return torch.where(x >= threshold, 1.0 - x, x)


def _sharpness(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """PIL's SMOOTH kernel (1 1 1 / 1 5 1 / 1 1 1) / 13 as the blurred base; borders unchanged."""
    c = x.shape[1]
    blurred = x.clone()
    blurred[:, :, 1:-1, 1:-1] = F.conv2d(x, _smooth_kernel(x.dtype, x.device).expand(c, 1, 3, 3), groups=c)
    return _blend(x, blurred, _enhance_factor(level, sign))


@lru_cache(maxsize=8)
def _smooth_kernel(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """PIL's SMOOTH kernel ``(3, 3)``, made once per dtype and device (read only)."""
    k = torch.ones(3, 3, dtype=dtype, device=device)
    k[1, 1] = 5.0
    return k / 13.0


def _affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Warp by per-sample 2x3 matrices (output -> input, normalised coords); outside is black (PIL)."""
    grid = _affine_grid(theta.to(x.device, x.dtype), x.shape[2], x.shape[3])
    return F.grid_sample(x - _FILL, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + _FILL


_WARP_OPS = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
"""The geometric ops: each is a per-sample 2x3 matrix (:func:`_warp_thetas`), so one warp applies any
mix of them to a batch."""
_ROTATE, _SHEAR_X, _SHEAR_Y, _TRANSLATE_X, _TRANSLATE_Y = (OP_NAMES.index(name) for name in _WARP_OPS)


def _warp_thetas(op_ids: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """Per-sample 2x3 matrices (CPU, output -> input, normalised coordinates) of geometric ops:
    rotation by ``sign 30 level`` degrees about the centre, shear by ``s = sign 0.3 level`` about the
    top-left corner, translation by ``sign 0.3 level`` of the side (RandAugmentMC's ranges and PIL's
    transforms). ``op_ids`` (M,) holds one geometric op id per sample.

    PIL's ShearX maps output pixel coordinates (from the corner) ``(x, y)`` to input ``(x + s y, y)``;
    in normalised coordinates (``-1`` at the corner's edge) that is ``x' = x + s y + s`` on a square
    image: the matrix ``[[1, s, s], [0, 1, 0]]`` (ShearY: ``[[1, 0, 0], [s, 1, s]]``)."""
    angle = torch.deg2rad(sign * _MAX_ROTATE_DEG * level)
    rotate, zero, one = op_ids == _ROTATE, torch.zeros(()), torch.ones(())
    shear, shift = sign * _MAX_SHEAR * level, 2.0 * sign * _MAX_TRANSLATE * level
    shear_x, shear_y = op_ids == _SHEAR_X, op_ids == _SHEAR_Y
    cos, sin = torch.where(rotate, torch.cos(angle), one), torch.where(rotate, torch.sin(angle), zero)
    neg_sin = torch.where(rotate, -torch.sin(angle), zero)  # not -sin: no -0.0 where nothing rotates
    theta = torch.stack(
        [
            cos,
            torch.where(shear_x, shear, neg_sin),
            torch.where(op_ids == _TRANSLATE_X, shift, torch.where(shear_x, shear, zero)),  # corner shear
            torch.where(shear_y, shear, sin),
            cos,
            torch.where(op_ids == _TRANSLATE_Y, shift, torch.where(shear_y, shear, zero)),
        ],
        dim=1,
    )
    return theta.view(-1, 2, 3)


@lru_cache(maxsize=8)
def _base_grid(h: int, w: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The output pixels' normalised x and y coordinates, each ``(1, 1, H, W)`` (``align_corners=False``)."""
    base = F.affine_grid(torch.eye(2, 3, dtype=dtype, device=device)[None], [1, 1, h, w], align_corners=False)
    return base[..., 0].clone().view(1, 1, h, w), base[..., 1].clone().view(1, 1, h, w)


def _affine_grid(theta: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``F.affine_grid(theta, (N, C, h, w), align_corners=False)`` at a third of its cost on CPU: the
    coordinates are built once per size, and each sample's 3-term sums are element-wise, in the order
    ``x t0 + y t1 + t2`` (and ``x t3 + y t4 + t5``), into an ``(N, 2, H, W)`` tensor returned as the
    ``(N, H, W, 2)`` grid it views (interleaving the two coordinates in memory cost more than the
    sums). On this project's CPU that gives exactly the values of ``F.affine_grid``'s batched matrix
    product; a BLAS that fuses multiply-adds (other CPUs, cuBLAS) may differ in the last bit, so the
    test allows float rounding."""
    xs, ys = _base_grid(h, w, theta.dtype, theta.device)
    t = theta.view(-1, 2, 3, 1, 1)
    return (xs * t[:, :, 0]).add_(ys * t[:, :, 1]).add_(t[:, :, 2]).permute(0, 2, 3, 1)


def _warp_op(op_id: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def warp(x: torch.Tensor, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        level, sign = level.cpu(), sign.cpu()  # the matrices are built on the CPU
        return _affine(x, _warp_thetas(torch.full(level.shape, op_id), level, sign))

    return warp


_Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_OPS: dict[str, _Op] = {
    "Identity": _identity,
    "AutoContrast": _autocontrast,
    "Brightness": _brightness,
    "Color": _color,
    "Contrast": _contrast,
    "Equalize": _equalize,
    "Posterize": _posterize,
    "Rotate": _warp_op(_ROTATE),
    "Sharpness": _sharpness,
    "ShearX": _warp_op(_SHEAR_X),
    "ShearY": _warp_op(_SHEAR_Y),
    "Solarize": _solarize,
    "TranslateX": _warp_op(_TRANSLATE_X),
    "TranslateY": _warp_op(_TRANSLATE_Y),
}

_WARP_KEY, _SKIP_KEY = len(OP_NAMES), -1
_GROUP_KEY = torch.tensor(
    [_SKIP_KEY if name == "Identity" else _WARP_KEY if name in _WARP_OPS else op for op, name in enumerate(OP_NAMES)]
)
"""Per op id, the group a strong slot applies it in: the op itself, one warp for every geometric op
(:data:`_WARP_KEY`), or none for Identity (:data:`_SKIP_KEY`)."""
_GROUP_KEY_ONE_CHANNEL = _GROUP_KEY.masked_fill(torch.arange(len(OP_NAMES)) == OP_NAMES.index("Color"), _SKIP_KEY)
""":data:`_GROUP_KEY` for one-channel images, where Color is skipped too: an image's grey is itself, and
``x + f (x - x)`` is ``x`` exactly."""


@lru_cache(maxsize=8)
def _warp_table(magnitudes: int, sign_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every geometric matrix a strong view can draw, ``(len(OP_NAMES), magnitudes, 2, 2, 3)``: entry
    ``[op, m, s]`` is :func:`_warp_thetas` of op ``op`` at level ``m / 10`` with sign ``-1`` (s = 0) or
    ``+1`` (s = 1), computed by that function on inputs of the dtypes :func:`sample_ops` draws (float32
    levels; signs of the default dtype, hence ``sign_dtype``), so a lookup is the matrix the strong view
    would build. Rows of other ops are unused."""
    ops, mags, signs = torch.meshgrid(
        torch.arange(len(OP_NAMES)), torch.arange(magnitudes), torch.tensor([-1, 1]), indexing="ij"
    )
    table = _warp_thetas(ops.reshape(-1), mags.reshape(-1).float() / _MAX_LEVEL, signs.reshape(-1).to(sign_dtype))
    return table.view(len(OP_NAMES), magnitudes, 2, 2, 3)


def apply_op(x: torch.Tensor, op_id: int, level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """Apply RandAugment op ``OP_NAMES[op_id]`` to every sample of ``x``.

    Parameters
    ----------
    x : torch.Tensor
        Float images ``(M, C, H, W)`` in ``[0, 1]``.
    op_id : int
        Index into :data:`OP_NAMES`.
    level : torch.Tensor
        ``(M,)`` magnitudes as fractions of the maximum, in ``(0, 1]``.
    sign : torch.Tensor
        ``(M,)`` of +1 / -1: the direction of rotations, shears, translations and enhancements.

    Returns
    -------
    torch.Tensor
        The transformed images, clipped to ``[0, 1]``.
    """
    name = OP_NAMES[op_id]
    if name not in _WARP_OPS:  # geometric ops build their matrices on the CPU; the rest work on x's device
        level, sign = level.to(x.device, x.dtype), sign.to(x.device, x.dtype)
    return _OPS[name](x, level, sign).clamp_(0.0, 1.0)


# --------------------------------------------------------------------------------------------
# strong augmentation
# --------------------------------------------------------------------------------------------


def sample_ops(
    n: int, generator: torch.Generator, num_ops: int = 2, magnitude: int = 10, op_prob: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw each sample's RandAugmentMC ops and their parameters (on the CPU).

    Parameters
    ----------
    n : int
        Batch size.
    generator : torch.Generator
        CPU generator.
    num_ops : int
        Ops per sample (drawn with replacement).
    magnitude : int
        RandAugment M out of 10: each op's magnitude is an integer uniform in ``[1, M)``
        (numpy's ``randint(1, M)``, as RandAugmentMC draws it; 1 for ``M <= 2``).
    op_prob : float
        Probability that a drawn op is applied (RandAugmentMC: 0.5).

    Returns
    -------
    ops : torch.Tensor
        int64 ``(n, num_ops)`` indices into :data:`OP_NAMES`.
    levels : torch.Tensor
        float32 ``(n, num_ops)``: magnitude / 10.
    signs : torch.Tensor
        float32 ``(n, num_ops)`` of +1 / -1 (the direction of geometric ops).
    applied : torch.Tensor
        bool ``(n, num_ops)``: whether each drawn op is applied.
    """
    ops = torch.randint(0, len(OP_NAMES), (n, num_ops), generator=generator)
    mags = torch.randint(1, max(int(magnitude), 2), (n, num_ops), generator=generator).float()
    signs = torch.where(torch.rand(n, num_ops, generator=generator) < 0.5, -1.0, 1.0)
    applied = torch.rand(n, num_ops, generator=generator) < op_prob
    return ops, mags / _MAX_LEVEL, signs, applied


def default_cutout(height: int) -> int:
    """The cutout size v for ``height``-pixel images (``CutoutAbs``'s argument; the filled square is
    v + 1 pixels a side): RandAugmentMC's 16 at 32x32 (H / 2), the SSFL benchmark authors' 7 at 28x28
    (H / 4); H / 2 from 32 up, H / 4 below."""
    return height // 2 if height >= 32 else height // 4


def apply_cutout(x: torch.Tensor, sides: torch.Tensor, centres: torch.Tensor, fill: float = _GREY) -> torch.Tensor:
    """Fill one square per sample with ``fill``: corner at ``centre - side // 2`` (at least 0), the far
    corner ``side`` pixels on, both inclusive as PIL's ``ImageDraw.rectangle`` draws them (``side + 1``
    pixels a side), clipped at the far border.

    Parameters
    ----------
    x : torch.Tensor
        ``(N, C, H, W)``.
    sides : torch.Tensor
        int64 ``(N,)`` the cutout sizes v in pixels (PIL's square of ``v + 1`` pixels; 0: no cutout).
    centres : torch.Tensor
        int64 ``(N, 2)`` (row, column) centres.
    fill : float
        Fill value.

    Returns
    -------
    torch.Tensor
        A new tensor with the squares filled.
    """
    _, _, h, w = x.shape
    return x.masked_fill(_cutout_mask(h, w, sides.to(x.device), centres.to(x.device)), fill)


def _cutout_mask(h: int, w: int, sides: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """The ``(N, 1, H, W)`` mask of :func:`apply_cutout`'s squares (on ``sides``' device)."""
    top = (centres[:, 0] - sides // 2).clamp_min(0)  # RandAugmentMC's CutoutAbs: corner clipped at 0,
    left = (centres[:, 1] - sides // 2).clamp_min(0)  # the far side at the border
    rows = torch.arange(h, device=sides.device).view(1, h)
    cols = torch.arange(w, device=sides.device).view(1, w)
    far = (sides > 0)[:, None]  # PIL's rectangle includes both corners: v + 1 pixels; v = 0 draws nothing here
    in_rows = (rows >= top[:, None]) & (rows <= (top + sides)[:, None]) & far  # (N, H)
    in_cols = (cols >= left[:, None]) & (cols <= (left + sides)[:, None])  # (N, W)
    return (in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(1)


_CUTOUT_TABLE_PIXELS = 32 * 32
"""Images up to this many pixels keep a table of every cutout mask (at most 1 MiB a size and side)."""


@lru_cache(maxsize=4)
def _cutout_table(h: int, w: int, side: int, device: torch.device) -> torch.Tensor:
    """Every ``side``-pixel square's mask by its centre, ``(H, W, 1, H, W)``: entry ``[r, c]`` is
    :func:`_cutout_mask` of centre ``(r, c)``, made by that function. Read only."""
    centres = torch.cartesian_prod(torch.arange(h, device=device), torch.arange(w, device=device))
    sides = torch.full((h * w,), side, dtype=torch.long, device=device)
    return _cutout_mask(h, w, sides, centres).view(h, w, 1, h, w)


def _cutout_squares(x: torch.Tensor, side: int, centres: torch.Tensor, fill: float = _GREY) -> torch.Tensor:
    """:func:`apply_cutout` with one ``side`` for every sample and centres inside the image (as
    :func:`_sample_cutout` draws them): the masks come from :func:`_cutout_table` on small images
    (one lookup instead of building each mask), so the result is apply_cutout's, bit for bit."""
    n, _, h, w = x.shape
    if h * w > _CUTOUT_TABLE_PIXELS:
        return apply_cutout(x, torch.full((n,), side, dtype=torch.long), centres, fill)
    centres = centres.to(x.device)
    return x.masked_fill(_cutout_table(h, w, side, x.device)[centres[:, 0], centres[:, 1]], fill)


def _sample_cutout(n: int, h: int, w: int, side: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed ``side`` per sample and uniform integer centres (all drawn on the CPU)."""
    sides = torch.full((n,), max(int(side), 0), dtype=torch.long)
    centres = torch.stack(
        [torch.randint(0, h, (n,), generator=generator), torch.randint(0, w, (n,), generator=generator)],
        dim=1,
    )
    return sides, centres


def strong_augment(
    x: torch.Tensor,
    generator: torch.Generator,
    *,
    flip: bool,
    num_ops: int = 2,
    magnitude: int = 10,
    op_prob: float = 0.5,
    cutout: int | None = None,
    pad: int | None = None,
    return_ops: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Strong augmentation A(): weak augmentation, RandAugmentMC, then a fixed cutout.

    Each sample draws ``num_ops`` ops from :data:`OP_NAMES` (with replacement); each drawn op is
    applied with probability ``op_prob`` at an integer magnitude uniform in ``[1, magnitude)``
    (out of 10) with a random direction; the batch is processed op type by op type, each op
    applied at once to the samples that drew it. Then a grey (127/255) square is cut out around a
    uniform random centre, ``cutout + 1`` pixels a side as PIL's inclusive rectangle, clipped at the
    border.

    Parameters
    ----------
    x : torch.Tensor
        Float images ``(N, C, H, W)`` in ``[0, 1]``, C = 1 or 3, on any device.
    generator : torch.Generator
        CPU generator all random draws come from.
    flip : bool
        Random horizontal flips in the weak stage.
    num_ops : int
        RandAugment N (ops per sample).
    magnitude : int
        RandAugment M (magnitudes are drawn below it, out of 10).
    op_prob : float
        Probability of applying each drawn op (0.5; 1 applies every op).
    cutout : int, optional
        Cutout size v in pixels (PIL's square of v + 1 pixels); default :func:`default_cutout` of H;
        0 disables cutout.
    pad : int, optional
        Shift range of the weak stage (default ``H // 8``).
    return_ops : bool
        Also return the op ids each sample drew (-1 where the op was not applied).

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        Augmented images in ``[0, 1]`` (a new tensor: ``x`` is left as it is); with ``return_ops``,
        also int64 ``(N, num_ops)`` op ids.
    """
    n, c, h, w = x.shape
    x = weak_augment(x, generator, flip=flip, pad=pad)
    ops, levels, signs, applied = sample_ops(n, generator, num_ops, magnitude, op_prob)
    side = default_cutout(h) if cutout is None else cutout
    _, centres = _sample_cutout(n, h, w, side, generator)
    x = x.clone()
    keys = (_GROUP_KEY if c > 1 else _GROUP_KEY_ONE_CHANNEL)[ops].masked_fill_(~applied, _SKIP_KEY)
    # the matrix each sample's geometric op would get (see _warp_table): its magnitude is levels * 10
    table = _warp_table(max(int(magnitude), 2), signs.dtype)
    thetas = table[ops, (levels * _MAX_LEVEL).round().long(), (signs > 0).long()]
    for slot in range(num_ops):
        # each sample's group in this slot (_GROUP_KEY), sorted by group (stable: sample order within),
        # each group is a slice of one gathered sub-batch
        key = keys[:, slot]
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key + 1, minlength=len(OP_NAMES) + 2).tolist()
        chosen = order[counts[0] :]  # counts[0]: the samples no op changes in this slot
        if len(chosen) == 0:
            continue
        dev_chosen = chosen.to(x.device)
        # x[...] keeps x's strides (index_select would not), and the sharpness blur's conv2d rounds
        # differently in another memory layout; a slice of it keeps them too
        sub = x[dev_chosen]
        lv = levels[chosen, slot].to(x.device, x.dtype)  # as apply_op moves them, once for the slot
        sg = signs[chosen, slot].to(x.device, x.dtype)
        start = 0
        for op_id, count in enumerate(counts[1:-1]):
            if count:  # apply_op of a non-geometric op
                part = slice(start, start + count)
                sub[part] = _OPS[OP_NAMES[op_id]](sub[part], lv[part], sg[part]).clamp_(0.0, 1.0)
                start += count
        if start < len(chosen):
            part = slice(start, None)
            sub[part] = _affine(sub[part], thetas[chosen[part], slot]).clamp_(0.0, 1.0)
        x[dev_chosen] = sub
    out = _cutout_squares(x, side, centres).clamp_(0.0, 1.0) if side > 0 else x.clamp_(0.0, 1.0)
    return (out, torch.where(applied, ops, -1)) if return_ops else out
