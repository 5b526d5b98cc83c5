"""The server's handshake keeps pace with a slow link (issue 26): a new challenge at most every heartbeat
interval, and enough challenges kept that answers queued behind each other on a 2 s round trip still count.
(Seen on the network lab under load: a challenge a second against answers a round trip apart, four kept,
and no answer ever matched again.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("fedml")

from fedml_ssfl.runtime.fedml import managers  # noqa: E402


def fake_server(heartbeat: float):
    sent = []
    server = SimpleNamespace(checked={}, limits=SimpleNamespace(heartbeat=heartbeat))
    server.check = lambda rank: (sent.append(rank), server.checked.__setitem__(rank, managers.time.monotonic()))
    return server, sent


def test_a_new_challenge_goes_out_at_most_every_heartbeat_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(managers.time, "monotonic", lambda: now[0])
    server, sent = fake_server(heartbeat=5.0)
    for _ in range(20):  # a stale answer or an "unknown" event every 0.5 s, for 10 s
        managers.SSFLServerManager.recheck(server, 1)
        now[0] += 0.5
    assert sent == [1, 1]  # at 100 s and at 105 s
    server, sent = fake_server(heartbeat=0.2)  # never more than one a second
    for _ in range(20):
        managers.SSFLServerManager.recheck(server, 2)
        now[0] += 0.5
    assert len(sent) == 10


def test_answers_queued_behind_each_other_on_a_slow_link_still_match(monkeypatch):
    """One challenge a second (the pace at a 1 s heartbeat) for 30 s; the worker's answers leave its outbox
    one per 2 s round trip, in order: each must still find its challenge kept when it arrives."""
    now = [0.0]
    monkeypatch.setattr(managers.time, "monotonic", lambda: now[0])
    server = SimpleNamespace(challenges={}, checked={}, send_message=lambda m: sent.append(m))
    sent, issued_at = [], []
    for second in range(30):
        now[0] = float(second)
        managers.SSFLServerManager.check(server, 1)
        issued_at.append(sent[-1].get(managers.CHALLENGE))
    stale = []
    for k, challenge in enumerate(issued_at[:15]):  # answer k arrives at 2k + 2 s: by 30 s, the 15th
        if challenge not in server.challenges[1]:
            stale.append(k)
    assert not stale, f"answers to challenges {stale} would be refused as not sent by this server"
