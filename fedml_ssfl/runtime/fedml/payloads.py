"""What crosses the wire between server and workers: tensors as NumPy arrays, and the checks a reply passes."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ...algorithms.base import Message, message_nbytes
from .protocol import RECORDS, fields_of
from .wire import WireArray

log = logging.getLogger(__name__)


_RECORDS = frozenset(RECORDS.values())

_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
}


def encode(obj: Any) -> Any:
    """Replace dense CPU-able tensors inside dicts / lists / tuples / Messages / protocol records by
    :class:`WireArray`."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided and obj.dtype in _NUMPY_DTYPES:
            return WireArray(obj.detach().cpu().numpy())
        return obj  # sparse, bfloat16, ...: torch's own pickling
    if isinstance(obj, Message):
        return Message(weights=encode(obj.weights), extras=encode(obj.extras), num_samples=obj.num_samples)
    if type(obj) in _RECORDS:
        return type(obj)(**{k: encode(v) for k, v in fields_of(obj).items()})
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, encode(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(encode(v) for v in obj)
    return obj


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode` (arrays become tensors sharing the unpickled memory)."""
    if isinstance(obj, WireArray):
        array = obj.array  # np.ascontiguousarray would turn a 0-d array (BatchNorm's counter) into shape (1,)
        return torch.from_numpy(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    if isinstance(obj, Message):
        return Message(weights=decode(obj.weights), extras=decode(obj.extras), num_samples=obj.num_samples)
    if type(obj) in _RECORDS:
        return type(obj)(**{k: decode(v) for k, v in fields_of(obj).items()})
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, decode(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(decode(v) for v in obj)
    return obj


def state_nbytes(state: Any) -> int:
    """Tensor bytes of a client state (same counting rule as ``message_nbytes``)."""
    return message_nbytes(Message(extras={"state": state})) if state else 0


def _tensors(obj: Any, path: str = ""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def check_reply(
    reply: Any,
    model_shapes: dict[str, tuple[int, ...]],
    sent: Message | None = None,
    partial_ok: bool = False,
) -> str | None:
    """Why a client's reply is malformed, or None when it is fine.

    Refused: not a :class:`Message`; weights naming tensors neither the model nor the message
    sent has; a shape different from the reference; NaN or inf anywhere (weights, or tensors in
    extras); a dense full-model reply missing model keys (unless ``partial_ok``); a negative or
    non-integer ``num_samples``.
    """
    if not isinstance(reply, Message):
        return f"expected a Message, got {type(reply).__name__}"
    if not isinstance(reply.weights, dict) or not isinstance(reply.extras, dict):
        return "weights and extras must be dicts"
    if not isinstance(reply.num_samples, int) or reply.num_samples < 0:
        return f"num_samples must be an integer >= 0, got {reply.num_samples!r}"
    ref = dict(model_shapes)
    if sent is not None:
        ref.update({k: tuple(t.shape) for k, t in sent.weights.items() if isinstance(t, torch.Tensor)})
    unknown = sorted(set(reply.weights) - set(ref))
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        return f"unknown weight keys: {shown}"
    sparse = False
    for name, t in reply.weights.items():
        if not isinstance(t, torch.Tensor):
            return f"weight {name!r} is a {type(t).__name__}, not a tensor"
        if tuple(t.shape) != tuple(ref[name]):
            return f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(ref[name])}"
        sparse = sparse or t.is_sparse
    missing = sorted(set(model_shapes) - set(reply.weights))
    if reply.weights and missing and not sparse and not partial_ok and set(reply.weights) <= set(model_shapes):
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        return f"missing weight keys: {shown}"
    extras = {k: v for k, v in reply.extras.items() if k != "metrics"}
    for name, t in [*_tensors(reply.weights), *_tensors(extras)]:
        values = t.coalesce().values() if t.is_sparse else t
        if (values.is_floating_point() or values.is_complex()) and not bool(torch.isfinite(values).all()):
            return f"non-finite values (NaN/inf) in {name!r}"
    return None
