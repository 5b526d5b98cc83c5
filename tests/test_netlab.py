"""Self-tests of the network lab (tests/netlab.py): the faults it sets are the faults traffic meets.

Each test builds hosts in their own network namespaces joined through the lab's hub and measures
what crosses a link with the lab's own tools: round trips against the delay set, the share of
datagrams lost against the loss set, silence during a cut and traffic after it, throughput under
tbf; and that a lab leaves no namespace or process behind, even when its test fails or its test
process is killed. Skipped, naming why, only where ``ip netns add`` is refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from tests.netlab import HERE, Lab, NamespacesRefused, cleanup_stale, delete_namespace, namespaces

PORT = 9000


def result(proc, timeout: float = 60) -> dict:
    """The JSON line a lab tool printed last, once it has exited."""
    code = proc.wait(timeout)
    assert code == 0, f"{proc.name} exit {code}:\n{proc.tail()}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(lab, src: str, dst: str, **kw) -> dict:
    args = [f"--{k}={v}" for k, v in kw.items() if v is not True] + [f"--{k}" for k, v in kw.items() if v is True]
    return result(lab.tool(src, "probe", "--to", f"{lab.ip(dst)}:{PORT}", *args), timeout=120)


def echo(lab, host: str):
    proc = lab.tool(host, "echo", "--bind", f"{lab.ip(host)}:{PORT}")
    proc.wait_for_output("ready", 30)
    return proc


def test_round_trips_match_the_delay_set_on_a_link(make_lab):
    """1 s +- 100 ms one-way on a's link, both ways: a UDP echo and a TCP connect / echo between a
    and b (b's link clean) take 2 x 1 s; on a clean link they take milliseconds; a delay on the up
    direction only adds once."""
    lab = make_lab(["a", "b"])
    echo(lab, "b")
    clean = probe(lab, "a", "b", count=5, wait=0.5, tcp=True)
    assert all(r is not None and r < 0.1 for r in clean["rtt"]), clean
    assert clean["tcp"]["connect"] < 0.1, clean

    lab.link("a").set(delay=1.0, jitter=0.1)
    slow = probe(lab, "a", "b", count=10, wait=2.6, tcp=True)
    rtts = slow["rtt"]
    assert None not in rtts, slow  # a delay loses nothing
    assert all(1.75 <= r <= 2.6 for r in rtts), rtts  # 2 x (1 s +- 0.1 s), plus a loaded machine's lag
    assert abs(statistics.median(rtts) - 2.0) < 0.15, rtts
    assert 1.75 <= slow["tcp"]["connect"] <= 2.6 and 1.75 <= slow["tcp"]["echo"] <= 2.6, slow["tcp"]
    print(
        f"\nnetlab delay 1 s +- 100 ms one-way: UDP rtt median {statistics.median(rtts):.3f} s "
        f"(min {min(rtts):.3f}, max {max(rtts):.3f}), TCP connect {slow['tcp']['connect']:.3f} s, "
        f"echo {slow['tcp']['echo']:.3f} s; clean median {statistics.median(clean['rtt']) * 1000:.2f} ms"
    )

    lab.link("a").set(delay=0.5, direction="up")
    lab.link("a").set(direction="down")
    one_way = probe(lab, "a", "b", count=5, wait=1.2)["rtt"]
    assert None not in one_way and all(0.48 <= r <= 0.9 for r in one_way), one_way


def test_loss_drops_about_the_share_set_each_way(make_lab):
    """20% loss on a's link up, 10% down: of 2000 datagrams a -> b about 80% arrive, b -> a about
    90%, and the hub's counts of what it dropped make up the difference."""
    lab = make_lab(["a", "b"])
    echo(lab, "b")
    echo(lab, "a")
    assert None not in probe(lab, "a", "b", count=2, wait=0.3)["rtt"]  # addresses resolved (ARP) before the loss
    link = lab.link("a")
    link.set(loss=0.2, direction="up")
    link.set(loss=0.1, direction="down")
    n = 2000
    shares = {}
    for src, dst, stage, p in (("a", "b", "up", 0.2), ("b", "a", "down", 0.1)):
        before = link.stats()[stage]["lost"]
        counter = lab.tool(dst, "count", "--bind", f"{lab.ip(dst)}:{PORT + 1}", "--idle", "1.5")
        counter.wait_for_output("ready", 30)
        result(lab.tool(src, "send", "--to", f"{lab.ip(dst)}:{PORT + 1}", f"--count={n}", "--interval=0.0005"))
        received = result(counter)["received"]
        lost = link.stats()[stage]["lost"] - before
        shares[stage] = 1 - received / n
        # binomial sd at n = 2000 is under 0.009: 0.04 is more than 4 sd
        assert abs(shares[stage] - p) < 0.04, (stage, received, n)
        # every missing datagram is the hub's doing (it may also have dropped an ARP frame or two)
        assert n - received <= lost <= n - received + 3, (stage, lost, n, received)
    print(f"\nnetlab loss set 20% up / 10% down: measured {shares['up']:.1%} / {shares['down']:.1%} of {n} datagrams")


def _replies(out: dict) -> list[tuple[float, bool]]:
    return [(t, r is not None) for t, r in zip(out["sent"], out["rtt"])]


def test_a_cut_blocks_all_traffic_and_then_restores_it(make_lab):
    """A timed cut of a's link (1.5 s, ended by the hub) and an open one (ended by the test): probes
    sent during a cut get no answer, probes before and after do."""
    lab = make_lab(["a", "b"])
    echo(lab, "b")
    link = lab.link("a")
    for how in ("timed", "restored"):
        runner = lab.tool("a", "probe", "--to", f"{lab.ip('b')}:{PORT}", "--count=70", "--interval=0.05", "--wait=0.5")
        time.sleep(1.0)
        if how == "timed":
            cut = link.cut(1.5)
            start, end = cut["start"], cut["until"]
        else:
            start = link.cut()["start"]
            assert link.cut()["until"] is None
            time.sleep(1.5)
            end = link.restore()["at"]
        out = _replies(result(runner))
        before = [ok for t, ok in out if t < start - 0.05]
        during = [ok for t, ok in out if start + 0.01 < t < end - 0.01]
        after = [ok for t, ok in out if t > end + 0.05]
        assert len(before) >= 5 and all(before), (how, out)
        assert len(during) >= 20 and not any(during), (how, out)
        assert len(after) >= 5 and all(after), (how, out)
        gap = max(t for t, ok in out if t < end and ok), min(t for t, ok in out if t > start and ok)
        print(
            f"\nnetlab {how} cut of {end - start:.2f} s: last answered probe {start - gap[0]:.3f} s before, "
            f"first {gap[1] - end:.3f} s after"
        )
    assert link.stats()["up"]["cut"] >= 40


def test_tbf_limits_throughput_each_way(make_lab):
    """tbf at 1 Mbit/s on a's link up, then on b's link down: a TCP stream a -> b runs at 125 kB/s
    +- 15%; without a limit the same stream runs many times faster."""
    lab = make_lab(["a", "b"])

    def stream(seconds: float) -> float:
        sink = lab.tool("b", "sink", "--bind", f"{lab.ip('b')}:{PORT}")
        sink.wait_for_output("ready", 30)
        lab.tool("a", "source", "--to", f"{lab.ip('b')}:{PORT}", f"--seconds={seconds}")
        marks = result(sink)["marks"]
        t0, b0 = next((t, b) for t, b in marks if t >= marks[0][0] + 0.5)  # past slow start and the bucket
        t1, b1 = marks[-1]
        return (b1 - b0) / (t1 - t0)

    free = stream(1.0)
    rates = {}
    for host, direction in (("a", "up"), ("b", "down")):
        lab.link(host).rate(1000, direction)
        rates[direction] = stream(2.5)
        lab.link(host).rate(None, direction)
        assert abs(rates[direction] / 125_000 - 1) < 0.15, (direction, rates)
    assert free > 4 * 125_000, free
    print(
        f"\nnetlab tbf 1 Mbit/s (125 kB/s): measured {rates['up'] / 1000:.1f} kB/s up, "
        f"{rates['down'] / 1000:.1f} kB/s down; unlimited {free / 1e6:.1f} MB/s"
    )


def test_hosts_reach_only_the_lab(make_lab):
    """A host's only route is the lab's /24: the machine's loopback services and outside addresses
    are out of reach from inside."""
    lab = make_lab(["a", "b"])
    routes = subprocess.run(["ip", "-n", lab.hosts["a"].ns, "route"], capture_output=True, text=True).stdout
    assert routes.strip().splitlines() == [f"{lab.subnet}.0/24 dev eth0 proto kernel scope link src {lab.ip('a')}"]
    with socket.socket() as listener:  # in the test's own namespace
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = textwrap.dedent(
            f"""
            import socket
            for addr in (("127.0.0.1", {port}), ("8.8.8.8", 53), ("192.168.0.1", 80)):
                try:
                    socket.create_connection(addr, timeout=3).close()
                    print(addr, "reached")
                except OSError as exc:
                    print(addr, type(exc).__name__)
            """
        )
        out = lab.spawn("a", [sys.executable, "-I", "-S", "-c", code], name="reach")
        assert out.wait(30) == 0, out.tail()
    lines = out.stdout.splitlines()
    assert lines == [
        f"('127.0.0.1', {port}) ConnectionRefusedError",
        "('8.8.8.8', 53) OSError",
        "('192.168.0.1', 80) OSError",
    ], lines


def test_a_lab_leaves_nothing_behind_when_its_test_fails(tmp_path):
    """An exception inside a lab, then a test process killed with a lab up: every process the lab
    started dies, and the namespaces are gone (the killed run's by the next lab's clean-up)."""
    try:
        lab = Lab(["a", "b"], tmp_path / "lab")
        lab.start()
    except NamespacesRefused as exc:
        pytest.skip(f"network namespaces refused: {exc}")
    made = [ns for ns in namespaces() if ns.startswith(lab.tag + "-")]
    assert len(made) == 3
    with pytest.raises(RuntimeError, match="a failing test"):
        with lab:
            proc = echo(lab, "a")
            raise RuntimeError("a failing test")
    assert proc.returncode == -signal.SIGKILL
    assert not [ns for ns in namespaces() if ns.startswith(lab.tag + "-")]

    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(HERE.parents[1])!r})
        from tests.netlab import Lab
        lab = Lab(["a"], Path({str(tmp_path / "killed")!r})).start()
        p = lab.tool("a", "echo", "--bind", lab.ip("a") + ":9000")
        p.wait_for_output("ready", 30)
        print(lab.tag, p.pid, flush=True)
        time.sleep(600)
        """
    )
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        tag, pid = killed.stdout.readline().split()
    finally:
        killed.kill()
        killed.wait()
    try:
        left = [ns for ns in namespaces() if ns.startswith(tag + "-")]
        assert len(left) == 2, left  # left behind by the killed run ...
        deadline = time.monotonic() + 10
        while _alive(int(pid)):
            assert time.monotonic() < deadline, f"process {pid} of the killed run's lab outlived it"
            time.sleep(0.1)
        assert set(left) <= set(cleanup_stale())  # ... and removed by the next lab's clean-up
        assert not [ns for ns in namespaces() if ns.startswith(tag + "-")]
    finally:  # this test failing leaves nothing behind either
        for ns in namespaces():
            if ns.startswith(tag + "-"):
                delete_namespace(ns)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
