"""A model whose output is a known function of its input, and input views that say which view they are.

For the tests that follow an algorithm's real step (tests/test_view_split.py, tests/test_schedules.py):
which view of which sample went into which forward pass, which outputs gave a pseudo-label and which
took the loss.

* :func:`coded_data`: a client's samples as 1 x 8 x 8 images whose pixel (0, 1) is the sample's id, the
  true label ``id % C``.
* :func:`tag_views` (with pytest's ``monkeypatch``): every :class:`~fedml_ssfl.training.InputPipeline`
  view writes its tag into pixel (0, 0) (``PLAIN``, ``WEAK``, ``STRONG``) and the number of the call that
  made it into pixel (7, 7), and leaves the rest of the image as it was (no random draw).
* :class:`KnownNet`: its logits are ``CONF`` on one class, ``(id + SHIFT[view]) % C`` (or the table a
  test gives), and 0 elsewhere, plus ``0 x`` a trainable bias: gradients reach the logits, but no
  weight ever moves, so every step of a run sees the same function. Each forward pass is recorded
  (:class:`Call`: the module, its mode, the input, the output and, after the backward pass, the
  gradient of the loss with respect to the output).

The gradient of a cross-entropy with respect to the logits is ``(softmax - onehot(y)) / N``: the row's
most negative entry is at its target ``y`` (:func:`targets`), and a row without gradient took no loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fedml_ssfl.contract import ClientData
from fedml_ssfl.training import InputPipeline

PLAIN, WEAK, STRONG = 1, 2, 3
"""The view tags written into pixel (0, 0)."""
SHIFT = {PLAIN: 0, WEAK: 1, STRONG: 2}
"""KnownNet's default class of sample ``i`` under a view: ``(i + SHIFT[view]) % C`` (plain: its true label)."""
CONF = 12.0
"""The winning logit: softmax confidence 0.99995 with 10 classes, above every threshold the papers use."""


def coded_data(client_id: int, num_unlabeled: int, num_labeled: int = 0, num_classes: int = 10) -> ClientData:
    """A client whose sample ``i`` is an image with ``i`` in pixel (0, 1) and the label ``i % C``;
    the first ``num_unlabeled`` samples are unlabeled, the others labeled."""
    n = num_unlabeled + num_labeled
    if n > 255:
        raise ValueError("coded_data: at most 255 samples (one uint8 pixel holds the id)")
    images = torch.zeros(n, 1, 8, 8, dtype=torch.uint8)
    images[:, 0, 0, 1] = torch.arange(n, dtype=torch.uint8)
    return ClientData(
        client_id=client_id,
        images=images,
        labels=torch.arange(n) % num_classes,
        unlabeled_idx=torch.arange(num_unlabeled),
        labeled_idx=torch.arange(num_unlabeled, n),
        num_classes=num_classes,
    )


def view_of(x: torch.Tensor) -> torch.Tensor:
    """The view tag of each row of a batch (0: not made by a tagged view, e.g. a noise probe)."""
    return x[:, 0, 0, 0].round().long().clamp(0, 3)


def ids_of(x: torch.Tensor) -> torch.Tensor:
    """The sample id of each row of a batch (meaningless for a mixture of two images)."""
    return (x[:, 0, 0, 1] * 255).round().long()


def draw_of(x: torch.Tensor) -> torch.Tensor:
    """The number of the view call that made each row (1 for the first call of the test)."""
    return (x[:, 0, 7, 7] * 255).round().long()


def tag_views(monkeypatch) -> None:
    """Every InputPipeline view writes its tag and its call number into the image; nothing else changes."""
    calls = [0]

    def tagged(tag: int) -> Callable:
        def view(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
            calls[0] += 1
            x = self.raw(images).clone()
            x[:, 0, 0, 0] = float(tag)
            x[:, 0, 7, 7] = calls[0] / 255.0
            return x

        return view

    monkeypatch.setattr(InputPipeline, "plain", tagged(PLAIN))
    monkeypatch.setattr(InputPipeline, "weak", tagged(WEAK))
    monkeypatch.setattr(InputPipeline, "strong", tagged(STRONG))


@dataclass
class Call:
    """One forward pass of a :class:`KnownNet`."""

    net: nn.Module
    training: bool
    x: torch.Tensor
    out: torch.Tensor
    grad: torch.Tensor | None = None

    @property
    def views(self) -> torch.Tensor:
        return view_of(self.x)

    @property
    def ids(self) -> torch.Tensor:
        return ids_of(self.x)


@dataclass
class Recorder:
    """The forward passes of every KnownNet built by :meth:`factory`, in order."""

    num_classes: int = 10
    classes: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """``classes(views, ids)``: each row's winning class (default ``(id + SHIFT[view]) % C``)."""
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    """``logits(x)``: the whole logit table instead of one winning class (e.g. chosen confidences)."""
    eval_shift: int = 0
    """Added to the winning class in eval mode (so that a label from an eval-mode pass is told apart)."""
    calls: list[Call] = field(default_factory=list)

    def factory(self) -> Callable[[], nn.Module]:
        return lambda: KnownNet(self)

    def trained(self) -> list[Call]:
        """The passes whose output took a gradient (the loss's forward passes)."""
        return [c for c in self.calls if c.grad is not None]

    def clear(self) -> None:
        self.calls.clear()


class KnownNet(nn.Module):
    """Logits that are a known function of the input (see the module docstring), recorded."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.bias = nn.Parameter(torch.zeros(recorder.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rec = self.recorder
        if rec.logits is not None:
            table = rec.logits(x)
        else:
            views, ids = view_of(x), ids_of(x)
            if rec.classes is not None:
                winner = rec.classes(views, ids)
            else:
                shift = torch.tensor([0, SHIFT[PLAIN], SHIFT[WEAK], SHIFT[STRONG]])[views]
                winner = ids + shift
            winner = (winner + (0 if self.training else rec.eval_shift)) % rec.num_classes
            table = torch.zeros(x.shape[0], rec.num_classes)
            table[torch.arange(x.shape[0]), winner] = CONF
        out = table.to(x.dtype) + 0 * self.bias
        call = Call(self, self.training, x.detach().clone(), out.detach().clone())
        rec.calls.append(call)
        if out.requires_grad:

            def keep(g: torch.Tensor, call: Call = call) -> None:
                call.grad = g.detach().clone() if call.grad is None else call.grad + g.detach()

            out.register_hook(keep)
        return out


def targets(grad: torch.Tensor) -> torch.Tensor:
    """The cross-entropy target of each row of a gradient with respect to the logits (its most
    negative entry); rows without gradient get -1."""
    out = grad.argmin(dim=1)
    out[grad.abs().sum(dim=1) == 0] = -1
    return out


def took_loss(grad: torch.Tensor) -> torch.Tensor:
    """Which rows of a gradient with respect to the logits are not zero."""
    return grad.abs().sum(dim=1) > 0
