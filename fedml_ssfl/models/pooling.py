"""2x2 max-pooling that computes what ``nn.MaxPool2d(2)`` does, faster on CPU without gradient.

PyTorch's CPU max-pooling kernel for NCHW tensors is slow at these sizes: on the project's 2-core
CPU (one thread) ``F.max_pool2d`` takes ~8 ms for a (121, 16, 28, 28) batch, even without gradient
(benchmarks/max_pool.py). With a 2x2 window and stride 2 the windows do not overlap, so the pooled
value is the element-wise maximum of the four strided views of the input (the four pixels of every
window): ~1 ms for that batch (and half ``F.max_pool2d``'s time in channels_last). The values and
the output's strides are ``F.max_pool2d``'s exactly (a maximum rounds nothing; NaN propagates the
same way; tests/test_pooling.py), so a model changes no result.

Only passes without gradient (evaluation, pseudo-labels, BatchNorm statistics) take this path: a
backward pass needs the position of each maximum, and every way of tracking it measured here cost
more than ``F.max_pool2d`` itself (the boolean and uint8 kernels it needs are slow on this CPU).
Inputs with one channel (whose strides can read as either layout) or a side below 2, other devices,
``torch.func`` transforms and forward-mode tangents, tracing and ONNX export use ``F.max_pool2d``
(``torch.jit.script`` cannot compile the module). A window of +0 and -0 may give the other zero
(equal values; the sign bit can differ).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad


def max_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool2d(x, 2)`` by the four strided views of each window (no gradient is tracked).

    Odd trailing rows and columns are dropped, as ``F.max_pool2d`` drops them.
    """
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    a, b = x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2]
    c, d = x[..., 1:h:2, 0:w:2], x[..., 1:h:2, 1:w:2]
    return torch.maximum(torch.maximum(a, b), torch.maximum(c, d))


class MaxPool2x2(nn.MaxPool2d):
    """``nn.MaxPool2d(2)``, with :func:`max_pool_2x2` for CPU inputs that need no gradient.

    Still an ``nn.MaxPool2d`` for whatever inspects a model (printing, ONNX export), and without
    parameters: state dicts and checkpoints are unchanged.
    The fast path's conditions: :func:`_fast_path_applies`.
    """

    def __init__(self) -> None:
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return max_pool_2x2(x) if _fast_path_applies(x) else F.max_pool2d(x, 2)


def _fast_path_applies(x: torch.Tensor) -> bool:
    """Whether :func:`max_pool_2x2` gives exactly what ``F.max_pool2d(x, 2)`` would, values and strides."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False  # a backward pass needs F.max_pool2d's choice of pixel
    if torch._C._functorch.is_functorch_wrapped_tensor(x) or forward_ad.unpack_dual(x).tangent is not None:
        return False  # vmap / forward-mode tangents: layout queries fail, and ties would split tangents
    return (
        x.dim() == 4
        and x.device.type == "cpu"
        and x.shape[1] > 1  # one channel: its strides are ambiguous, and the next conv reads them
        and x.shape[2] >= 2
        and x.shape[3] >= 2  # F.max_pool2d refuses a side below the window
        and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))
    )
