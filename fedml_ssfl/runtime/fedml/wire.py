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

Anything else is refused with :class:`WireError` before an object is built: unknown tags, a
dtype outside the list, a shape that does not match its bytes, a buffer range outside the message,
a header or a message larger than the limits, nesting deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ... import envvars
from ...algorithms.base import Message
from ...data.silos import SiloMeta
from . import protocol

MAGIC = b"SSFLWIRE1"
MAX_DEPTH = 64
MAX_HEADER_BYTES = 64 * 2**20
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
    return envvars.nbytes(MAX_MESSAGE_ENV, DEFAULT_MAX_MESSAGE_BYTES)


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
        for r in ranges:
            if not (
                isinstance(r, list)
                and len(r) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in r)
                and r[0] + r[1] <= body.nbytes
            ):
                raise WireError(f"buffer range {r!r} lies outside the message")
        self.body, self.ranges, self.fedml_message_class = body, ranges, fedml_message_class

    def buffer(self, index: Any) -> memoryview:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.ranges):
            raise WireError(f"buffer reference {index!r} is not in the table")
        start, n = self.ranges[index]
        return self.body[start : start + n]

    @staticmethod
    def shape(spec: Any) -> tuple[int, ...]:
        if not isinstance(spec, list) or len(spec) > 32:
            raise WireError(f"shape {spec!r} is not a list of at most 32 sizes")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in spec):
            raise WireError(f"shape {spec!r} has a size that is not a non-negative integer")
        return tuple(spec)

    def array(self, spec: Any) -> np.ndarray:
        if not isinstance(spec, list) or len(spec) != 3 or spec[0] not in _DTYPES:
            raise WireError(f"array spec {str(spec)[:80]!r}: expected [dtype among the codec's, shape, buffer]")
        dtype, shape, raw = _DTYPES[spec[0]], self.shape(spec[1]), self.buffer(spec[2])
        if math.prod(shape) * dtype.itemsize != raw.nbytes:
            raise WireError(f"array of {spec[0]} {list(shape)} does not fit its {raw.nbytes} bytes")
        return np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)  # a writable copy

    def tensor(self, spec: Any, depth: int) -> torch.Tensor:
        if not isinstance(spec, list) or len(spec) != 3 or spec[0] not in _FROM_NAME:
            raise WireError(f"tensor spec {str(spec)[:80]!r}: expected [dtype among the codec's, shape, buffer]")
        dtype, shape, raw = _FROM_NAME[spec[0]], self.shape(spec[1]), self.buffer(spec[2])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != raw.nbytes:
            raise WireError(f"tensor of {spec[0]} {list(shape)} does not fit its {raw.nbytes} bytes")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw.nbytes else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)

    def node(self, x: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"nesting deeper than {MAX_DEPTH}")
        d = depth + 1
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise WireError(f"node {str(x)[:80]!r} is not one of the codec's")
        if "a" in x and set(x) <= {"a", "w"}:
            array = self.array(x["a"])
            return WireArray(array) if x.get("w") else array
        if len(x) != 1:
            raise WireError(f"node {str(x)[:80]!r} is not one of the codec's")
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
            indices, values = self.node(v[0], d), self.node(v[1], d)
            size = self.shape(v[2])
            if not (isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)):
                raise WireError("a sparse tensor needs tensor indices and values")
            if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[0] != len(size):
                raise WireError("a sparse tensor's indices do not match its size")
            if indices.numel() and (
                bool((indices < 0).any()) or bool((indices.max(dim=1).values >= torch.tensor(size)).any())
            ):
                raise WireError("a sparse tensor's indices fall outside its size")
            return torch.sparse_coo_tensor(indices, values, size, check_invariants=True).coalesce()
        if tag == "M" and isinstance(v, dict) and set(v) == {"weights", "extras", "n"}:
            weights, extras = self.node(v["weights"], d), self.node(v["extras"], d)
            if not isinstance(weights, dict) or not isinstance(extras, dict) or not isinstance(v["n"], int):
                raise WireError("a Message needs dict weights, dict extras and an integer sample count")
            return Message(weights=weights, extras=extras, num_samples=v["n"])
        if tag == "K" and isinstance(v, dict) and set(v) == set(SiloMeta.__dataclass_fields__):
            return SiloMeta(**{k: self.node(e, d) for k, e in v.items()})
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
            msg = self.fedml_message_class()
            msg.init_from_json_object(params)
            return msg
        raise WireError(f"node tag {tag!r} is not one of the codec's")

    def key(self, x: Any, depth: int) -> Any:
        k = self.node(x, depth)
        if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
            raise WireError(f"a dict key of type {type(k).__name__} is not allowed")
        return k


def loads(data: bytes | bytearray | memoryview, fedml_message_class: type | None = None) -> Any:
    """Decode a message written by :func:`dumps`; :class:`WireError` for anything else."""
    view = memoryview(data).cast("B")
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
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"header is not JSON ({exc})") from None
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
