"""The outbox (fedml_ssfl.runtime.fedml.delivery): sends never block the caller, retries within the outage
budget, a lasting cause at once, duplicates count as delivered, a peer that does not know this process
is reported; with a stand-in for gRPC's send."""

from __future__ import annotations

import threading
import time

from fedml_ssfl.runtime.fedml.delivery import Item, Outbox, SendError, Undelivered, Unknown
from fedml_ssfl.runtime.fedml.diagnose import Cause


class Peer:
    """A scripted peer: ``codes`` are the answers to successive attempts (then OK); records what arrived."""

    def __init__(self, codes=(), gate: threading.Event | None = None):
        self.codes = list(codes)
        self.gate = gate
        self.arrived: list[bytes] = []
        self.attempts = 0

    def send(self, envelope: bytes, timeout: float) -> None:
        if self.gate is not None:
            assert self.gate.wait(30)
        self.attempts += 1
        code = self.codes.pop(0) if self.codes else "OK"
        if code != "OK":
            raise SendError(code, "scripted")
        self.arrived.append(envelope)


REFUSED = Cause("connection refused at x: no process listens there")


def outbox(peer: Peer, budget=60.0, cause=REFUSED):
    reports: list = []
    box = Outbox(3, peer.send, budget, reports.append, lambda: cause)
    return box, reports


def test_put_returns_at_once_while_a_send_waits_and_order_is_kept():
    gate = threading.Event()
    peer = Peer(gate=gate)
    box, reports = outbox(peer)
    t0 = time.monotonic()
    for i in range(3):
        box.put(Item(b"m%d" % i, f"message {i}"))
    assert time.monotonic() - t0 < 0.5 and box.pending() == 3
    gate.set()
    assert box.drain(10)
    assert peer.arrived == [b"m0", b"m1", b"m2"] and not reports
    box.close()


def test_transient_failures_are_retried_until_the_peer_answers():
    peer = Peer(["UNAVAILABLE", "UNAVAILABLE", "DEADLINE_EXCEEDED"])
    box, reports = outbox(peer)
    box.put(Item(b"task", "a task"))
    assert box.drain(30)
    assert peer.arrived == [b"task"] and peer.attempts == 4 and not reports
    box.close()


def test_a_peer_unreachable_for_the_budget_is_reported_with_the_diagnosed_cause():
    peer = Peer(["UNAVAILABLE"] * 1000)
    box, reports = outbox(peer, budget=2.0)
    t0 = time.monotonic()
    box.put(Item(b"task", "a task of round 3"))
    assert box.drain(30)
    took = time.monotonic() - t0
    assert 1.9 <= took < 10, took
    (event,) = reports
    assert isinstance(event, Undelivered) and event.label == "a task of round 3" and event.peer == 3
    assert "connection refused" in event.cause and "FEDML_SSFL_OUTAGE_BUDGET 2 s" in event.cause and not peer.arrived
    box.close()


def test_a_lasting_cause_is_reported_at_once():
    peer = Peer(["UNAVAILABLE"] * 1000)
    box, reports = outbox(peer, budget=600, cause=Cause("the certificate presented at x has expired", True))
    t0 = time.monotonic()
    box.put(Item(b"task", "a task"))
    assert box.drain(30) and time.monotonic() - t0 < 5
    assert [type(r) for r in reports] == [Undelivered] and "expired" in reports[0].cause
    box.close()


def test_a_duplicate_counts_as_delivered_and_a_refusal_is_final():
    peer = Peer(["ALREADY_EXISTS", "PERMISSION_DENIED"])
    box, reports = outbox(peer)
    box.put(Item(b"a", "first"))
    box.put(Item(b"b", "second"))
    assert box.drain(10)
    assert peer.attempts == 2 and [r.label for r in reports] == ["second"] and reports[0].code == "PERMISSION_DENIED"
    box.close()


def test_a_peer_that_does_not_know_this_session_is_reported_and_the_message_dropped():
    peer = Peer(["FAILED_PRECONDITION"])
    box, reports = outbox(peer)
    box.put(Item(b"a", "a task"))
    box.put(Item(b"b", "the next"))
    assert box.drain(10)
    assert [type(r) for r in reports] == [Unknown] and peer.arrived == [b"b"]
    box.close()


def test_a_droppable_message_is_tried_once_and_clear_drops_what_waits():
    gate = threading.Event()
    peer = Peer(["UNAVAILABLE"], gate=gate)
    box, reports = outbox(peer)
    box.put(Item(b"hello", "a hello", droppable=True))
    box.put(Item(b"stale", "an old task"))
    time.sleep(0.2)
    assert box.clear() == 1
    gate.set()
    assert box.drain(10)
    assert peer.attempts == 1 and not peer.arrived and not reports
    box.close()
