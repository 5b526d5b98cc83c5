"""The FedML transport's codec: exact round trips of every payload type, and nothing built from hostile bytes."""

from __future__ import annotations

import json
import math
import os
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch

from fedml_ssfl.algorithms.base import Message
from fedml_ssfl.data.silos import SiloMeta
from fedml_ssfl.runtime.fedml import wire
from fedml_ssfl.runtime.fedml.wire import WireArray, WireError


class _Pwned:
    """A pickle that writes a file when unpickled (the proof of concept, harmless)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _frame(header: dict, body: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return wire.MAGIC + len(h).to_bytes(8, "big") + h + body


def test_every_payload_type_round_trips_exactly():
    meta = SiloMeta(
        num_classes=3, class_names=["a", "b", "c"], in_channels=1, image_size=28, mean=(0.5,), std=(0.2,), flip=False
    )
    payload = {
        "kind": "round",
        "round": 3,
        "ok": True,
        "none": None,
        "nan": float("nan"),
        "msg": Message(
            weights=OrderedDict(w=WireArray(np.arange(6, dtype=np.float32).reshape(2, 3)), n=torch.tensor(7)),
            extras={"metrics": {"loss": 0.5}, "bf": torch.ones(3, dtype=torch.bfloat16), "flags": torch.tensor([True])},
            num_samples=12,
        ),
        "sparse": torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse(),
        "states": {0: {"momentum": {"w": torch.randn(2, 2)}}, 2: {}},
        "pair": (1, "x", [2.5, None]),
        "meta": meta,
        "raw": b"\x00\x01",
        "empty": torch.zeros(0, 4),
    }
    out = wire.loads(wire.dumps(payload))
    assert out["kind"] == "round" and out["round"] == 3 and out["ok"] is True and out["none"] is None
    assert math.isnan(out["nan"]) and out["pair"] == (1, "x", [2.5, None]) and out["raw"] == b"\x00\x01"
    m = out["msg"]
    assert isinstance(m, Message) and m.num_samples == 12 and isinstance(m.weights, OrderedDict)
    assert np.array_equal(m.weights["w"].array, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert m.weights["n"].shape == () and int(m.weights["n"]) == 7
    assert m.extras["bf"].dtype == torch.bfloat16 and m.extras["flags"].dtype == torch.bool
    assert torch.equal(out["sparse"].to_dense(), payload["sparse"].to_dense())
    assert set(out["states"]) == {0, 2} and torch.equal(
        out["states"][0]["momentum"]["w"], payload["states"][0]["momentum"]["w"]
    )
    assert out["meta"] == meta and out["empty"].shape == (0, 4)
    m.weights["w"].array[0, 0] = 1.0  # decoded arrays are writable copies


def test_a_pickle_is_refused_and_runs_nothing(tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(WireError, match="not a fedml_ssfl wire message"):
        wire.loads(pickle.dumps(_Pwned(target)))
    with pytest.raises(WireError, match="not a fedml_ssfl wire message"):
        wire.loads(b"not a pickle")
    assert not target.exists()
    with pytest.raises(WireError, match="cannot travel"):
        wire.dumps({"x": _Pwned(target)})  # nor can such an object be sent


@pytest.mark.parametrize(
    ("header", "body", "reason"),
    [
        ({"v": {"a": ["object", [1], 0]}, "b": [[0, 8]]}, bytes(8), "dtype among the codec's"),
        ({"v": {"a": ["float32", [3], 0]}, "b": [[0, 8]]}, bytes(8), "does not fit its 8 bytes"),
        ({"v": {"T": ["float32", [2], 0]}, "b": [[0, 800]]}, bytes(8), "lies outside the message"),
        ({"v": {"T": ["float32", [-2], 0]}, "b": [[0, 8]]}, bytes(8), "not a non-negative integer"),
        ({"v": {"X": 1}, "b": []}, b"", "tag 'X' is not one of the codec's"),
        ({"v": {"d": {"a": {"l": [1, {"Z": 0}]}}}, "b": []}, b"", "tag 'Z'"),
        ({"v": {"M": {"weights": 1, "extras": {"d": {}}, "n": 1}}, "b": []}, b"", "Message needs dict weights"),
        ({"v": 1}, b"", "lacks its value and buffer table"),
        ({"v": {"B": 5}, "b": []}, b"", "buffer reference 5"),
    ],
)
def test_malformed_messages_are_refused_before_anything_is_built(header, body, reason):
    with pytest.raises(WireError, match=reason):
        wire.loads(_frame(header, body))


def test_size_depth_and_header_limits(monkeypatch):
    deep: dict = {"l": []}
    node = deep
    for _ in range(wire.MAX_DEPTH + 5):
        node["l"].append({"l": []})
        node = node["l"][0]
    with pytest.raises(WireError, match="nesting deeper"):
        wire.loads(_frame({"v": deep, "b": []}))
    with pytest.raises(WireError, match="header length"):
        wire.loads(wire.MAGIC + (10**9).to_bytes(8, "big") + b"{}")
    data = wire.dumps({"w": torch.zeros(1000)})
    monkeypatch.setenv(wire.MAX_MESSAGE_ENV, "1000")
    with pytest.raises(WireError, match=f"exceeds the limit of 1000 \\({wire.MAX_MESSAGE_ENV}\\)"):
        wire.loads(data)
    monkeypatch.delenv(wire.MAX_MESSAGE_ENV)
    assert torch.equal(wire.loads(data)["w"], torch.zeros(1000))


def test_fedml_messages_round_trip_with_their_class():
    fedml_message = pytest.importorskip("fedml.core.distributed.communication.message")
    FedMessage = fedml_message.Message
    msg = FedMessage("sync", 0, 2)
    msg.add_params("model_params", {1: {"kind": "idle"}})
    dumps, loads = wire.codec(FedMessage)
    back = loads(dumps(msg))
    assert isinstance(back, FedMessage) and back.get_type() == "sync" and back.get_receiver_id() == 2
    assert back.get("model_params") == {1: {"kind": "idle"}}
    with pytest.raises(WireError, match="tag 'F'"):
        wire.loads(dumps(msg))  # without FedML's class nothing of FedML's is built
    assert os.environ.get(wire.MAX_MESSAGE_ENV) is None


def test_protocol_records_round_trip_and_bad_fields_are_refused():
    from fedml_ssfl.runtime.fedml.protocol import Failure, Finish, Intro, Reply, Task

    meta = SiloMeta(
        num_classes=2, class_names=["a", "b"], in_channels=1, image_size=8, mean=(0.5,), std=(0.2,), flip=False
    )
    task = Task(
        3,
        1,
        2,
        msg=Message(weights={"w": torch.ones(2)}),
        state={"m": torch.zeros(1)},
        state_tag=2,
        upload=[1],
        drop=[4],
        checkpoint=True,
        intro=Intro(meta, "run", 2),
    )
    back = wire.loads(wire.dumps(task))
    assert isinstance(back, Task) and back.intro.meta == meta and back.upload == [1] and back.drop == [4]
    assert torch.equal(back.msg.weights["w"], task.msg.weights["w"]) and back.checkpoint is True
    reply = Reply(3, 1, 2, msg=Message(num_samples=5), states={1: (3, {"m": torch.ones(1)})})
    back = wire.loads(wire.dumps(reply))
    assert isinstance(back, Reply) and back.states[1][0] == 3 and torch.equal(back.states[1][1]["m"], torch.ones(1))
    assert wire.loads(wire.dumps(Failure(3, 1, 2, "boom"))).describe() == "rank 2 (silo 1) failed in round 4: boom"
    assert isinstance(wire.loads(wire.dumps(Finish())), Finish)

    def forged(name, fields):
        return _frame({"v": {"R": [name, fields]}, "b": []})

    good = {"round": 1, "silo": 0, "rank": 1, "trained": True, "msg": None, "states": {"d": {}}, "more": {"l": []}}
    for name, fields, reason in [
        ("Pwned", {}, "not a protocol record"),
        ("Reply", {**good, "round": "1"}, "Reply.round must be an integer"),
        ("Reply", {**good, "extra": 1}, "needs the fields"),
        ("Reply", {k: v for k, v in good.items() if k != "rank"}, "needs the fields"),
        ("Reply", {**good, "states": {"p": [[1, {"d": {}}]]}}, "round, state dict"),
    ]:
        with pytest.raises(WireError, match=reason):
            wire.loads(forged(name, fields))
    assert isinstance(wire.loads(forged("Reply", good)), Reply)


# ---- malformed input of every kind: only WireError, nothing allocated beyond the message -------------------------


def test_a_sparse_tensor_whose_counts_or_sizes_disagree_is_refused_naming_it():
    good = wire.dumps({"s": torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))})
    header_len = int.from_bytes(good[len(wire.MAGIC) : len(wire.MAGIC) + 8], "big")
    start = len(wire.MAGIC) + 8
    header = json.loads(good[start : start + header_len])
    body = good[start + header_len :]
    indices, values, _ = header["v"]["d"]["s"]["S"]

    def with_sparse(idx_spec, val_spec, size):
        return _frame({"v": {"S": [{"T": idx_spec}, {"T": val_spec}, size]}, "b": header["b"]}, body)

    i_spec, v_spec = indices["T"], values["T"]
    cases = [
        (with_sparse(i_spec, ["float32", [1], 1], [4]), "2 indices but 1 values"),  # counts differ (bytes regrouped)
        (with_sparse(i_spec, v_spec, [4, 3]), "values of shape \\[2\\] do not fit the size \\[4, 3\\]"),
        (with_sparse(i_spec, v_spec, [2**62, 2**62, 0]), "more than 2\\^48 elements"),
        (with_sparse(i_spec, v_spec, [2]), "indices fall outside its size"),
        (with_sparse(["int32", [1, 4], 0], v_spec, [4]), "indices must be a 2-D int64 tensor"),
    ]
    # keep the byte counts consistent where a case regroups them: 2 float32 values -> 1 value + 4 spare bytes
    cases[0] = (
        _frame(
            {"v": {"S": [{"T": i_spec}, {"T": ["float32", [1], 1]}, [4]]}, "b": [header["b"][0], [16, 4], [20, 4]]},
            body,
        ),
        "2 indices but 1 values",
    )
    for data, reason in cases:
        with pytest.raises(WireError, match=reason):
            wire.loads(data)


def test_a_shape_beyond_the_limit_is_refused_before_anything_is_allocated():
    for node in ({"T": ["float32", [2**62, 2**62, 0], 0]}, {"a": ["float32", [2**31, 2**31, 0], 0]}):
        with pytest.raises(WireError, match="more than 2\\^48 elements"):
            wire.loads(_frame({"v": node, "b": [[0, 0]]}))
    assert wire.loads(_frame({"v": {"T": ["float32", [2**20, 0], 0]}, "b": [[0, 0]]})).shape == (2**20, 0)


def test_a_buffer_used_twice_or_ranges_that_overlap_are_refused():
    body = bytes(8)
    twice = {"l": [{"T": ["float32", [2], 0]}, {"T": ["float32", [2], 0]}]}
    with pytest.raises(WireError, match="buffer 0 is referenced twice"):
        wire.loads(_frame({"v": twice, "b": [[0, 8]]}, body))
    overlap = {"l": [{"T": ["float32", [2], 0]}, {"T": ["float32", [2], 1]}]}
    with pytest.raises(WireError, match="does not start where the previous one ends"):
        wire.loads(_frame({"v": overlap, "b": [[0, 8], [0, 8]]}, body))
    with pytest.raises(WireError, match="4 bytes follow the last buffer"):
        wire.loads(_frame({"v": {"T": ["float32", [1], 0]}, "b": [[0, 4]]}, body))


@pytest.mark.parametrize(
    ("header", "body", "reason"),
    [
        ({"v": {"T": [["float32"], [1], 0]}, "b": [[0, 4]]}, bytes(4), "dtype among the codec's"),
        ({"v": {"a": [{"x": 1}, [1], 0]}, "b": [[0, 4]]}, bytes(4), "dtype among the codec's"),
        ({"v": {"p": [[{"t": [{"l": []}]}, 1]]}, "b": []}, b"", "dict key"),
        ({"v": {"T": ["bool", [2], 0]}, "b": [[0, 2]]}, b"\x01\x07", "bool .* other than 0 and 1"),
        ({"v": {"M": {"weights": {"d": {}}, "extras": {"d": {}}, "n": -3}}, "b": []}, b"", "sample count"),
        ({"v": {"M": {"weights": {"d": {}}, "extras": {"d": {}}, "n": True}}, "b": []}, b"", "sample count"),
    ],
)
def test_more_malformed_nodes_are_refused_by_name(header, body, reason):
    with pytest.raises(WireError, match=reason):
        wire.loads(_frame(header, body))


def test_a_silo_meta_with_fields_of_the_wrong_type_is_refused():
    meta = {
        "num_classes": 2,
        "class_names": {"l": ["a", "b"]},
        "in_channels": 1,
        "image_size": 8,
        "mean": {"t": [0.5]},
        "std": {"t": [0.2]},
        "flip": False,
    }
    assert isinstance(wire.loads(_frame({"v": {"K": meta}, "b": []})), SiloMeta)
    for key, bad in [("num_classes", "2"), ("class_names", {"l": [1]}), ("mean", 0.5), ("flip", 1), ("image_size", -8)]:
        with pytest.raises(WireError, match=f"SiloMeta.{key}"):
            wire.loads(_frame({"v": {"K": {**meta, key: bad}}, "b": []}))


def test_bytes_that_are_not_bytes_or_a_header_with_a_huge_number_are_refused():
    with pytest.raises(WireError, match="header is not JSON"):
        wire.loads(_frame_text('{"v": ' + "9" * 5000 + ', "b": []}'))
    with pytest.raises(WireError, match="not bytes"):
        wire.loads("a string")  # type: ignore[arg-type]


def _frame_text(text: str) -> bytes:
    h = text.encode()
    return wire.MAGIC + len(h).to_bytes(8, "big") + h


FUZZ_CASES = 5000
"""Mutations the fuzz test decodes (about 4 s, with the process start, on the 2-core CI machine)."""


def fuzz_samples() -> list[tuple[str, object]]:
    """One valid object of every kind the codec carries: each protocol record, a Message, a SiloMeta, a
    FedML message (when FedML is installed), sparse and hybrid sparse tensors, arrays, bytes."""
    from fedml_ssfl.runtime.fedml.protocol import Failure, Finish, Intro, Reply, Task

    meta = SiloMeta(
        num_classes=3, class_names=["a", "b", "c"], in_channels=1, image_size=8, mean=(0.5,), std=(0.2,), flip=True
    )
    msg = Message(
        weights=OrderedDict(
            w=torch.arange(6, dtype=torch.float32).reshape(2, 3), b=torch.ones(3, dtype=torch.bfloat16)
        ),
        extras={
            "metrics": {"loss": 0.5, "acc": float("nan")},
            "delta": torch.sparse_coo_tensor(torch.tensor([[0, 3], [1, 0]]), torch.tensor([1.5, -2.0]), (4, 2)),
            "hybrid": torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 3), (2, 3)),
            "mask": torch.tensor([True, False]),
            "arr": WireArray(np.arange(4, dtype=np.int16)),
            "np": np.ones((2, 2), dtype=np.float64),
            "raw": b"\x00\x01\x02",
            "pairs": {(1, "x"): None, 2: (3.0, [True])},
        },
        num_samples=7,
    )
    samples: list[tuple[str, object]] = [
        (
            "task",
            Task(
                2,
                1,
                2,
                msg=msg,
                state={"m": torch.zeros(2)},
                upload=[1],
                drop=[0],
                checkpoint=True,
                intro=Intro(meta, "run", 1),
            ),
        ),
        ("reply", Reply(2, 1, 2, msg=msg, states={1: (2, {"m": torch.ones(2)})})),
        ("failure", Failure(2, 1, 2, "boom", "Traceback ...")),
        ("finish", Finish()),
        ("intro", Intro(meta, "run", -1)),
        ("message", msg),
        ("meta", meta),
        ("ordered", OrderedDict(a=torch.zeros(0, 4), b=torch.tensor(3.0))),
    ]
    try:
        from fedml.core.distributed.communication.message import Message as FedMessage
    except ImportError:
        return samples
    fed = FedMessage(3, 0, 2)
    fed.add_params("model_params", {1: samples[0][1]})
    samples.append(("fedml", fed))
    return samples


def _nasty(rng) -> object:
    """A value a hostile or broken peer might put anywhere in a header."""
    pool = [
        -1,
        0,
        1,
        2,
        7,
        2**31,
        2**62,
        2**64,
        10**40,
        -(2**63),
        1.5,
        float("nan"),
        float("inf"),
        True,
        False,
        None,
        "",
        "x",
        "float32",
        "bfloat16",
        "bool",
        "int64",
        "Task",
        "Reply",
        "R",
        "S",
        "T",
        [],
        {},
        [2**62, 2**62, 0],
        [2**31, 2**31],
        [0, 10**9],
        [[0, 4]],
        [[0, 2**40]],
        {"T": ["float32", [2], 0]},
        {"S": [{"T": ["int64", [1, 1], 0]}, {"T": ["float32", [3], 0]}, [4]]},
        {"R": ["Task", {}]},
        {"l": [{"l": []}]},
        {"a": ["float32", [1], 0], "w": 1},
        {"B": 0},
        {"K": {}},
        {"M": {"weights": {"d": {}}, "extras": {"d": {}}, "n": 1}},
        {"p": [[{"l": []}, 1]]},
        {"F": {"d": {}}},
    ]
    return pool[rng.randrange(len(pool))]


def _places(tree, out, parent=None, key=None):
    """Every (container, key) position in a JSON tree."""
    if parent is not None:
        out.append((parent, key))
    if isinstance(tree, dict):
        for k in list(tree):
            _places(tree[k], out, tree, k)
    elif isinstance(tree, list):
        for i in range(len(tree)):
            _places(tree[i], out, tree, i)


ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}


def _tensor_specs(tree, out) -> None:
    """Every dense tensor or array spec ``[dtype, shape, buffer]`` in a header tree."""
    if isinstance(tree, dict):
        for tag in ("T", "a"):
            spec = tree.get(tag)
            if isinstance(spec, list) and len(spec) == 3 and spec[0] in ITEMSIZE and isinstance(spec[1], list):
                out.append(spec)
        for v in tree.values():
            _tensor_specs(v, out)
    elif isinstance(tree, list):
        for v in tree:
            _tensor_specs(v, out)


def mutate(data: bytes, rng) -> bytes:
    """One random corruption of an encoded message: of its bytes, its header's tree, or its buffer table."""
    import copy

    start = len(wire.MAGIC) + 8
    n = int.from_bytes(data[len(wire.MAGIC) : start], "big")
    kind = rng.randrange(10)
    if kind == 0:  # flip bytes anywhere
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 1:  # cut, or add bytes
        cut = rng.randrange(len(data))
        return (
            data[:cut] if rng.random() < 0.5 else data[:cut] + bytes(rng.randrange(256) for _ in range(5)) + data[cut:]
        )
    if kind == 2:  # flip bytes in the buffers only (the header stays valid)
        b = bytearray(data)
        if len(b) > start + n:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(start + n, len(b))] = rng.randrange(256)
        return bytes(b)
    header, body = json.loads(data[start : start + n]), data[start + n :]
    tree = copy.deepcopy(header)
    if kind == 3:  # regroup a tensor's bytes: another shape or dtype of the same byte count (sizes stay consistent)
        specs: list = []
        _tensor_specs(tree, specs)
        if specs:
            spec = specs[rng.randrange(len(specs))]
            nbytes = math.prod(spec[1]) * ITEMSIZE[spec[0]]
            dtype = rng.choice([d for d, size in ITEMSIZE.items() if nbytes % size == 0])
            count = nbytes // ITEMSIZE[dtype]
            split = rng.choice([d for d in range(1, count + 1) if count % d == 0] or [1])
            spec[0], spec[1] = dtype, rng.choice([[count], [split, count // split], [count // split, split, 1], []])
            if spec[1] == [] and count != 1:
                spec[1] = [count]
    for _ in range(rng.randint(1, 3) if kind > 3 else 0):
        places: list = []
        _places(tree, places)
        if not places:
            break
        parent, key = places[rng.randrange(len(places))]
        action = rng.randrange(6)
        if action <= 2:
            parent[key] = _nasty(rng)
        elif action == 3 and isinstance(parent, dict):
            del parent[key]
        elif action == 4 and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += rng.choice([-1, 1, 4, -4, 2**32])
        else:
            parent[key] = _nasty(rng)
    text = json.dumps(tree, separators=(",", ":")).encode()
    if rng.random() < 0.1:
        body = body[: rng.randrange(len(body) + 1)]
    return wire.MAGIC + len(text).to_bytes(8, "big") + text + body


def fuzz(cases: int, seed: int = 0) -> dict:
    """Decode ``cases`` mutations of the samples; return what escaped other than WireError, the peak RSS rise."""
    import random
    import resource

    samples = fuzz_samples()
    cls = type(samples[-1][1]) if samples[-1][0] == "fedml" else None
    encoded = [(name, wire.dumps(obj, cls)) for name, obj in samples]
    for _name, data in encoded:  # the samples themselves decode
        wire.loads(data, cls)

    def peak() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    before = peak()
    rng = random.Random(seed)
    escaped, refused = [], 0
    for i in range(cases):
        name, data = encoded[i % len(encoded)]
        bad = mutate(data, rng)
        try:
            wire.loads(bad, cls)
        except WireError:
            refused += 1
        except Exception as exc:  # the failure this test looks for
            escaped.append(f"case {i} ({name}): {type(exc).__name__}: {str(exc)[:200]}")
    return {"cases": cases, "refused": refused, "escaped": escaped, "peak_rise": peak() - before}


def test_fuzz_thousands_of_mutations_of_every_record_type_raise_only_wire_error():
    """In a fresh process, so that its peak memory is the codec's own: thousands of corruptions of valid
    messages of every kind decode to a value or raise WireError, never anything else, and never allocate
    more than a few MiB above what the valid messages took."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = f"import json; from tests.test_wire import fuzz; print(json.dumps(fuzz({FUZZ_CASES})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop(wire.MAX_MESSAGE_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["escaped"] == [], "\n".join(out["escaped"][:20])
    assert out["cases"] == FUZZ_CASES and out["refused"] > FUZZ_CASES // 2, out
    assert out["peak_rise"] < 64 * 2**20, out
