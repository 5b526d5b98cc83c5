"""The FedML transport's codec: no pickle, a size limit, a schema check before anything is built.

A message on the wire is::

    b"SSFLWIRE1" | header length (8 bytes, big-endian) | JSON header | raw buffers

The header is a tree of tagged nodes; tensors and arrays are references to byte ranges of the
buffer part, with their dtype (from a fixed list) and shape, checked against the range's length.
Only these nodes exist, so decoding can build nothing else:

* JSON scalars: ``str``, ``int``, ``float`` (NaN and infinities included), ``bool``, ``None``;
* ``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"d": {str: node}}`` dict with string keys,
  ``{"p": [[key node, value node], ...]}`` dict with other keys, ``{"o": [...]}`` OrderedDict;
* ``{"a": [dtype, shape, buffer]}`` NumPy array (``"w": 1`` marks the transport's
  :class:`WireArray`), ``{"T": [dtype, shape, buffer]}`` dense
  tensor (bfloat16 and the NumPy dtypes), ``{"S": [indices, values, size]}`` sparse COO tensor,
  ``{"B": buffer}`` bytes;
* ``{"M": {...}}`` :class:`~fedml_ssfl.algorithms.base.Message`, ``{"K": {...}}``
  :class:`~fedml_ssfl.data.silos.SiloMeta`, ``{"R": [name, {...}]}`` a record of the server <->
  worker protocol (:mod:`.protocol`; its fields are checked as it is built), ``{"F": {...}}``
  FedML's transport message (its parameter dict; the class is supplied by the transport).

Anything else is refused with :class:`WireError` naming what is wrong, before an object is built:
unknown tags, a dtype outside the list, a shape of more than :data:`MAX_DIMS` sizes or describing more
than :data:`MAX_ELEMENTS` elements, a shape that does not match its bytes, buffer ranges that do not
tile the message's buffer part (each starts where the previous one ends, the last ends where the
message does) or a buffer used twice, a sparse tensor whose indices and values disagree in count or
shape or fall outside its size, a bool tensor with bytes other than 0 and 1, a dict key that is not a
plain value, a record, Message, SiloMeta or FedML message whose fields have the wrong types, a header
that is not JSON, a header or a message larger than the limits, nesting deeper than
:data:`MAX_DEPTH`. Every size is checked against the message's own length (or the limits) before
memory is taken for it, and every buffer is copied at most once, so decoding a message allocates at
most its buffer bytes plus what the JSON header's parse takes (at most :data:`MAX_HEADER_BYTES`).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...algorithms.base import Message
from ...data.silos import SiloMeta
from . import protocol

MAGIC = b"SSFLWIRE1"
MAX_DEPTH = 64
MAX_HEADER_BYTES = 64 * 2**20
MAX_DIMS = 32
"""The most sizes a shape may have (NumPy's own limit)."""
MAX_ELEMENTS = 2**48
"""The most elements a shape may describe, a size 0 counted as 1: far above any model's tensor, and far
below where torch's and NumPy's size arithmetic overflows (a dense tensor's bytes must also match its
buffer, so a dense shape is bounded by the message length too)."""
MAX_MESSAGE_ENV = "FEDML_SSFL_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**30

_DTYPES = {
    name: np.dtype(name)
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool", "complex64")
}
_TORCH_DTYPES = {
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.bfloat16: "bfloat16",
}
_FROM_NAME = {v: k for k, v in _TORCH_DTYPES.items()}
_RECORD_TYPES = frozenset(protocol.RECORDS.values())


class WireError(ValueError):
    """Bytes that are not a well-formed fedml_ssfl wire message (the reason says what is wrong)."""


class WireArray:
    """A dense tensor on the wire as a NumPy array; ``payloads.decode`` turns it back."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def max_message_bytes() -> int:
    """The size limit for one message (``FEDML_SSFL_MAX_MESSAGE_BYTES``, default 4 GiB)."""
    text = os.environ.get(MAX_MESSAGE_ENV, "").strip()
    try:
        return int(text) if text else DEFAULT_MAX_MESSAGE_BYTES
    except ValueError:
        return DEFAULT_MAX_MESSAGE_BYTES


# ---- encoding ---------------------------------------------------------------------------------


class _Writer:
    def __init__(self, fedml_message_class: type | None):
        self.buffers: list[bytes | memoryview] = []
        self.offset = 0
        self.ranges: list[list[int]] = []
        self.fedml_message_class = fedml_message_class

    def buffer(self, data: bytes | memoryview) -> int:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        self.buffers.append(data)
        self.ranges.append([self.offset, n])
        self.offset += n
        return len(self.ranges) - 1

    def array(self, a: np.ndarray) -> list:
        a = np.ascontiguousarray(a) if a.ndim else a
        name = a.dtype.name
        if name not in _DTYPES:
            raise WireError(f"arrays of dtype {name} cannot travel; convert to one of {', '.join(_DTYPES)}")
        return [name, list(a.shape), self.buffer(a.tobytes())]

    def node(self, x: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"nesting deeper than {MAX_DEPTH}")
        d = depth + 1
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, (int, np.integer)):
            return int(x)
        if isinstance(x, (float, np.floating)):
            return float(x)
        if isinstance(x, np.bool_):
            return bool(x)
        if isinstance(x, bytes):
            return {"B": self.buffer(x)}
        if isinstance(x, WireArray):
            return {"a": self.array(x.array), "w": 1}
        if isinstance(x, np.ndarray):
            return {"a": self.array(x)}
        if isinstance(x, torch.Tensor):
            return self.tensor(x, d)
        if isinstance(x, Message):
            return {"M": {"weights": self.node(x.weights, d), "extras": self.node(x.extras, d), "n": x.num_samples}}
        if isinstance(x, SiloMeta):
            return {"K": {k: self.node(getattr(x, k), d) for k in SiloMeta.__dataclass_fields__}}
        if type(x) in _RECORD_TYPES:
            return {"R": [type(x).__name__, {k: self.node(v, d) for k, v in protocol.fields_of(x).items()}]}
        if self.fedml_message_class is not None and isinstance(x, self.fedml_message_class):
            return {"F": self.node(x.get_params(), d)}
        if isinstance(x, OrderedDict):
            return {"o": [[self.node(k, d), self.node(v, d)] for k, v in x.items()]}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                return {"d": {k: self.node(v, d) for k, v in x.items()}}
            return {"p": [[self.node(k, d), self.node(v, d)] for k, v in x.items()]}
        if isinstance(x, list):
            return {"l": [self.node(v, d) for v in x]}
        if isinstance(x, tuple):
            return {"t": [self.node(v, d) for v in x]}
        raise WireError(f"a {type(x).__name__} cannot travel on the wire (not in the codec's schema)")

    def tensor(self, t: torch.Tensor, depth: int) -> dict:
        t = t.detach().cpu()
        if t.layout == torch.sparse_coo:
            t = t.coalesce()
            return {"S": [self.tensor(t.indices(), depth), self.tensor(t.values(), depth), list(t.shape)]}
        if t.layout != torch.strided:
            raise WireError(f"tensors of layout {t.layout} cannot travel; send them dense or sparse COO")
        name = _TORCH_DTYPES.get(t.dtype)
        if name is None:
            raise WireError(f"tensors of dtype {t.dtype} cannot travel")
        t = t.contiguous()
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        return {"T": [name, list(t.shape), self.buffer(raw.numpy().tobytes())]}


def dumps(obj: Any, fedml_message_class: type | None = None) -> bytes:
    """Encode ``obj`` (see the module docstring for what may travel)."""
    w = _Writer(fedml_message_class)
    tree = w.node(obj)
    header = json.dumps({"v": tree, "b": w.ranges}, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return b"".join([MAGIC, len(header).to_bytes(8, "big"), header, *w.buffers])


# ---- decoding ---------------------------------------------------------------------------------


class _Reader:
    def __init__(self, body: memoryview, ranges: Any, fedml_message_class: type | None):
        if not isinstance(ranges, list):
            raise WireError("buffer table is not a list")
        end = 0  # the buffers tile the body: each starts where the previous one ends
        for i, r in enumerate(ranges):
            if not (
                isinstance(r, list)
                and len(r) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in r)
            ):
                raise WireError(f"buffer range {_show(r)} is not [offset, length]")
            if r[0] != end:
                raise WireError(f"buffer {i} {_show(r)} does not start where the previous one ends ({end})")
            if r[1] > body.nbytes - end:
                raise WireError(f"buffer range {_show(r)} lies outside the message")
            end += r[1]
        if end != body.nbytes:
            raise WireError(f"{body.nbytes - end} bytes follow the last buffer")
        self.body, self.ranges, self.fedml_message_class = body, ranges, fedml_message_class
        self.used: set[int] = set()  # a buffer is read (and copied) once: decoded bytes <= the message's

    def buffer(self, index: Any) -> memoryview:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.ranges):
            raise WireError(f"buffer reference {_show(index)} is not in the table")
        if index in self.used:
            raise WireError(f"buffer {index} is referenced twice")
        self.used.add(index)
        start, n = self.ranges[index]
        return self.body[start : start + n]

    @staticmethod
    def shape(spec: Any) -> tuple[int, ...]:
        if not isinstance(spec, list) or len(spec) > MAX_DIMS:
            raise WireError(f"shape {_show(spec)} is not a list of at most {MAX_DIMS} sizes")
        elements = 1
        for v in spec:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise WireError(f"shape {_show(spec)} has a size that is not a non-negative integer")
            elements *= max(v, 1)
            if elements > MAX_ELEMENTS:
                raise WireError(
                    f"shape {_show(spec)} describes more than 2^{MAX_ELEMENTS.bit_length() - 1} elements "
                    "(the codec's limit)"
                )
        return tuple(spec)

    def array(self, spec: Any) -> np.ndarray:
        if not isinstance(spec, list) or len(spec) != 3 or not isinstance(spec[0], str) or spec[0] not in _DTYPES:
            raise WireError(f"array spec {_show(spec)}: expected [dtype among the codec's, shape, buffer]")
        dtype, shape = _DTYPES[spec[0]], self.shape(spec[1])
        raw = self.buffer(spec[2])
        if math.prod(shape) * dtype.itemsize != raw.nbytes:
            raise WireError(f"array of {spec[0]} {list(shape)} does not fit its {raw.nbytes} bytes")
        data = bytearray(raw)  # a writable copy
        _check_bools(spec[0], data)
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def tensor(self, spec: Any, depth: int) -> torch.Tensor:
        if not isinstance(spec, list) or len(spec) != 3 or not isinstance(spec[0], str) or spec[0] not in _FROM_NAME:
            raise WireError(f"tensor spec {_show(spec)}: expected [dtype among the codec's, shape, buffer]")
        dtype, shape = _FROM_NAME[spec[0]], self.shape(spec[1])
        raw = self.buffer(spec[2])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != raw.nbytes:
            raise WireError(f"tensor of {spec[0]} {list(shape)} does not fit its {raw.nbytes} bytes")
        data = bytearray(raw)
        _check_bools(spec[0], data)
        flat = torch.frombuffer(data, dtype=torch.uint8) if raw.nbytes else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)

    def sparse(self, v: list, depth: int) -> torch.Tensor:
        """A sparse COO tensor ``[indices, values, size]``, checked as torch's constructor would, but by name."""
        size = self.shape(v[2])
        indices, values = self.node(v[0], depth), self.node(v[1], depth)
        if not (isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)):
            raise WireError("a sparse tensor needs tensor indices and values")
        if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[0] > len(size):
            raise WireError(
                f"a sparse tensor's indices must be a 2-D int64 tensor of at most {len(size)} rows (its size "
                f"{list(size)}), got {_spec_of(indices)}"
            )
        sparse_dim, nnz = indices.shape
        if values.dim() == 0 or values.shape[0] != nnz:
            count = values.shape[0] if values.dim() else "no"
            raise WireError(f"a sparse tensor has {nnz} indices but {count} values")
        if tuple(values.shape[1:]) != size[sparse_dim:]:
            raise WireError(
                f"a sparse tensor's values of shape {list(values.shape)} do not fit the size {list(size)} "
                f"({sparse_dim} sparse dims)"
            )
        if nnz and sparse_dim:
            bound = torch.tensor(size[:sparse_dim]).unsqueeze(1)
            if bool((indices < 0).any()) or bool((indices >= bound).any()):
                raise WireError(f"a sparse tensor's indices fall outside its size {list(size)}")
        # the invariants torch would check (10-40x the cost) were checked above, each refusal naming its reason
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=False).coalesce()

    def node(self, x: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"nesting deeper than {MAX_DEPTH}")
        d = depth + 1
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise WireError(f"node {_show(x)} is not one of the codec's")
        if "a" in x and set(x) <= {"a", "w"}:
            array = self.array(x["a"])
            return WireArray(array) if x.get("w") else array
        if len(x) != 1:
            raise WireError(f"node {_show(x)} is not one of the codec's")
        ((tag, v),) = x.items()
        if tag == "l" and isinstance(v, list):
            return [self.node(e, d) for e in v]
        if tag == "t" and isinstance(v, list):
            return tuple(self.node(e, d) for e in v)
        if tag == "d" and isinstance(v, dict):
            return {k: self.node(e, d) for k, e in v.items()}
        if tag in ("p", "o") and isinstance(v, list):
            if not all(isinstance(kv, list) and len(kv) == 2 for kv in v):
                raise WireError("a key-value list holds something other than pairs")
            pairs = [(self.key(kv[0], d), self.node(kv[1], d)) for kv in v]
            return OrderedDict(pairs) if tag == "o" else dict(pairs)
        if tag == "B":
            return bytes(self.buffer(v))
        if tag == "T":
            return self.tensor(v, d)
        if tag == "S" and isinstance(v, list) and len(v) == 3:
            return self.sparse(v, d)
        if tag == "M" and isinstance(v, dict) and set(v) == {"weights", "extras", "n"}:
            weights, extras, n = self.node(v["weights"], d), self.node(v["extras"], d), v["n"]
            if not isinstance(weights, dict) or not isinstance(extras, dict) or not _count(n):
                raise WireError("a Message needs dict weights, dict extras and a non-negative integer sample count")
            return Message(weights=weights, extras=extras, num_samples=n)
        if tag == "K" and isinstance(v, dict) and set(v) == set(SiloMeta.__dataclass_fields__):
            fields = {k: self.node(e, d) for k, e in v.items()}
            for k, value in fields.items():
                if not _META_FIELDS[k](value):
                    raise WireError(f"SiloMeta.{k} must be {_META_TYPES[k]}, got {_show(value)}")
            return SiloMeta(**fields)
        if tag == "R" and isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], dict):
            values = {k: self.node(e, d) for k, e in v[1].items()}
            try:
                return protocol.build(v[0], values)
            except (TypeError, ValueError) as exc:
                raise WireError(f"protocol record: {exc}") from None
        if tag == "F" and self.fedml_message_class is not None:
            params = self.node(v, d)
            if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
                raise WireError("a FedML message needs a parameter dict with string keys")
            if not {"msg_type", "sender", "receiver"} <= set(params):
                raise WireError("a FedML message needs msg_type, sender and receiver")
            if not (
                isinstance(params["msg_type"], (int, str))
                and not isinstance(params["msg_type"], bool)
                and _count(params["sender"])
                and _count(params["receiver"])
            ):
                raise WireError("a FedML message needs an int or str msg_type and non-negative integer ranks")
            msg = self.fedml_message_class()
            msg.init_from_json_object(params)
            return msg
        raise WireError(f"node tag {tag!r} is not one of the codec's")

    def key(self, x: Any, depth: int) -> Any:
        k = self.node(x, depth)
        if not _plain_key(k):
            raise WireError(f"a dict key of type {type(k).__name__} is not allowed (plain values and tuples of them)")
        return k


def _show(x: Any) -> str:
    """``repr(x)``, cut to 80 characters (a refusal names the bad value, not a megabyte of it)."""
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _plain_key(k: Any) -> bool:
    """A value that may key a decoded dict: a scalar, or a tuple of them (hashable by value)."""
    if k is None or isinstance(k, (str, int, float, bool)):
        return True
    return isinstance(k, tuple) and all(_plain_key(e) for e in k)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_bools(dtype: str, data: bytearray) -> None:
    """A bool tensor's bytes are 0 or 1 (torch and NumPy read any other byte as a corrupt bool)."""
    if dtype == "bool" and data.translate(None, b"\x00\x01"):
        raise WireError("a bool tensor holds bytes other than 0 and 1")


def _spec_of(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _positive(v: Any) -> bool:
    return _count(v) and v > 0


def _floats(v: Any) -> bool:
    return isinstance(v, tuple) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


_META_FIELDS: dict[str, Callable[[Any], bool]] = {
    "num_classes": _positive,
    "class_names": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "in_channels": _positive,
    "image_size": _positive,
    "mean": _floats,
    "std": _floats,
    "flip": lambda v: isinstance(v, bool),
}
_META_TYPES = {
    "num_classes": "a positive integer",
    "class_names": "a list of strings",
    "in_channels": "a positive integer",
    "image_size": "a positive integer",
    "mean": "a tuple of numbers",
    "std": "a tuple of numbers",
    "flip": "a boolean",
}


def loads(data: bytes | bytearray | memoryview, fedml_message_class: type | None = None) -> Any:
    """Decode a message written by :func:`dumps`; :class:`WireError` for anything else."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise WireError(f"a {type(data).__name__} is not bytes") from None
    limit = max_message_bytes()
    if view.nbytes > limit:
        raise WireError(f"message of {view.nbytes} bytes exceeds the limit of {limit} ({MAX_MESSAGE_ENV})")
    head = len(MAGIC) + 8
    if view.nbytes < head or bytes(view[: len(MAGIC)]) != MAGIC:
        raise WireError(f"not a fedml_ssfl wire message ({view.nbytes} bytes, no {MAGIC.decode()} marker)")
    n = int.from_bytes(view[len(MAGIC) : head], "big")
    if n > MAX_HEADER_BYTES or head + n > view.nbytes:
        raise WireError(f"header length {n} does not fit the message")
    try:
        header = json.loads(bytes(view[head : head + n]))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError, a number too long
        raise WireError(f"header is not JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict) or set(header) != {"v", "b"}:
        raise WireError("header lacks its value and buffer table")
    try:
        return _Reader(view[head + n :], header["b"], fedml_message_class).node(header["v"])
    except RecursionError:
        raise WireError(f"nesting deeper than {MAX_DEPTH}") from None


def codec(fedml_message_class: type | None = None) -> tuple[Callable[[Any], bytes], Callable[[Any], Any]]:
    """``(dumps, loads)`` bound to FedML's message class (for ``MPI.pickle`` and the GRPC transport)."""
    return (lambda obj: dumps(obj, fedml_message_class), lambda buf: loads(buf, fedml_message_class))


__all__ = ["WireArray", "WireError", "codec", "dumps", "loads", "max_message_bytes"]


class WireMeter:
    """Serialized bytes actually sent / received, by FedML message type (thread-safe)."""

    def __init__(self, message_class: type | None = None) -> None:
        self.lock = threading.Lock()
        self.sent: dict[Any, int] = {}
        self.recv: dict[Any, int] = {}
        self.message_class = message_class  # FedML's transport message (set when FedML is imported)

    @staticmethod
    def _type(obj: Any) -> Any:
        get = getattr(obj, "get_type", None)
        try:
            return get() if callable(get) else None
        except Exception:
            return None

    def count(self, table: dict, obj: Any, n: int) -> None:
        t = self._type(obj)
        with self.lock:
            table[t] = table.get(t, 0) + n

    def total(self, table: dict, types: tuple) -> int:
        with self.lock:
            return sum(table.get(t, 0) for t in types)

    def dumps(self, obj: Any) -> bytes:
        """Encode with :mod:`~fedml_ssfl.runtime.wire` (no pickle), counting the bytes."""
        data = dumps(obj, self.message_class)
        self.count(self.sent, obj, len(data))
        return data

    def loads(self, buf: Any) -> Any:
        """Decode with :mod:`~fedml_ssfl.runtime.wire`; :class:`~fedml_ssfl.runtime.wire.WireError` for
        bytes that are not a well-formed message (nothing is built from them)."""
        obj = loads(buf, self.message_class)
        self.count(self.recv, obj, memoryview(buf).nbytes)
        return obj
