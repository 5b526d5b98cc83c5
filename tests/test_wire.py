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

    good = {"round": 1, "silo": 0, "rank": 1, "trained": True, "msg": None, "states": {"d": {}}}
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
