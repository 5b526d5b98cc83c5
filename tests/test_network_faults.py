"""A deployment-mode GRPC job on a real network (tests/netlab.py) with faults on its links.

The server and two silos run ``fedml-ssfl run --rank R --role server|client`` in network namespaces
of their own (10.201.0.1-3, mutual TLS with certificates naming those addresses, a job key), each
silo holding only its own exported data file; the hub between them delays, drops, cuts and
throttles their traffic, and processes are killed and restarted. Every scenario must end with
exactly the simulator's model (``run_local`` on the same split and seed) within a bounded time.

The runtime's waiting budgets are left at the defaults a user gets (``FEDML_SSFL_ROUND_TIMEOUT``
3600 s, ``FEDML_SSFL_CONNECT_TIMEOUT`` 300 s, ``FEDML_SSFL_OUTAGE_BUDGET`` 120 s, ``FEDML_SSFL_HEARTBEAT_INTERVAL``
5 s, ``FEDML_SSFL_IDLE_TIMEOUT`` 6 h, ``FEDML_SSFL_FINISH_GRACE`` 30 s: the test runner's own values
are removed); each scenario's wall-clock bound is the test's, and a run that has not ended by then
is killed and reported with every process's output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import load_config
from fedml_ssfl.experiment import export_deployment
from fedml_ssfl.runtime.fedml.worker import saved_rounds
from fedml_ssfl.runtime.local import run_local
from tests.conftest import SMALL
from tests.lab_job import lab_job_config
from tests.netlab import Proc

pytest.importorskip("fedml")
pytest.importorskip("grpc")

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "fedml-ssfl"
HOSTS = ["server", "silo0", "silo1"]  # rank r runs on HOSTS[r]
SUBNET = "10.201.0"
PORT = 8890
BUDGETS = (
    "FEDML_SSFL_ROUND_TIMEOUT",
    "FEDML_SSFL_CONNECT_TIMEOUT",
    "FEDML_SSFL_OUTAGE_BUDGET",
    "FEDML_SSFL_HEARTBEAT_INTERVAL",
    "FEDML_SSFL_IDLE_TIMEOUT",
    "FEDML_SSFL_FINISH_GRACE",
)

SETTINGS = [
    *SMALL,
    "train_args.client_num_in_total=2",
    "train_args.client_num_per_round=2",  # both silos train every round: each saves its state every round
    "train_args.comm_round=3",
    "ssfl_args.algorithm=fedavg_ssl",
    "ssfl_args.threshold=0.5",
    "ssfl_args.bootstrap_steps=30",  # pseudo-labels from round 0: the silos' momentum state matters
    "device_args.num_threads=1",
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The exported deployment (per-silo files), certificates for the lab's addresses, the GRPC
    config every process reads, and the simulator's run of the same split (the reference)."""
    tmp = tmp_path_factory.mktemp("netjob")
    sim = load_config(None, [*SETTINGS, f"common_args.output_dir={tmp / 'runs'}", "common_args.run_name=sim"])
    exported = export_deployment(sim, tmp / "data", backend="GRPC")
    config = lab_job_config(tmp, exported, len(HOSTS), SUBNET, PORT)
    local = run_local(sim, run_dir=tmp / "local")
    return {"config": config, "local": local.run_dir}


def by_round(run_dir: Path) -> dict[int, float]:
    """Each round's test accuracy in ``run_dir/metrics.jsonl`` (a round written twice: its last row)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {r["round"]: r["test_acc"] for r in rows}


class Job:
    """One scenario's run: the processes of ranks 0..2 on the lab's hosts, their restarts, and the checks.

    ``env``: environment variables for every process beside the defaults (e.g. a shorter waiting
    budget, where a scenario needs one to stay bounded).
    """

    def __init__(self, lab, job: dict, tmp: Path, name: str, **env: str):
        self.lab, self.config, self.reference = lab, job["config"], job["local"]
        self.output = tmp / "runs"
        self.run_dir = self.output / name
        self.record = tmp / "net.record"
        self.sets = ["--set", f"common_args.output_dir={self.output}", "--set", f"common_args.run_name={name}"]
        self.env = {k: v for k, v in os.environ.items() if k not in BUDGETS}
        self.env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", FEDML_SSFL_NET_RECORD=str(self.record))
        self.env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
        self.env.update(env)
        self.procs: dict[int, Proc] = {}
        self._seen: dict[Path, tuple] = {}
        self.t0 = time.monotonic()

    def start(self, rank: int, resume: bool = False) -> Proc:
        """Start (or, after a kill, start again) rank ``rank`` on its host; ``resume``: with --resume."""
        role = "server" if rank == 0 else "client"
        argv = [str(CLI), "run", "--cf", str(self.config), "--rank", str(rank), "--role", role, *self.sets]
        if resume:
            argv += ["--resume", str(self.run_dir)]
        old = self.procs.get(rank)
        if old is None:
            self.procs[rank] = self.lab.spawn(HOSTS[rank], argv, env=self.env, name=f"rank{rank}")
        else:
            self.procs[rank] = self.lab.restart(old, argv)  # logs: rank<r>.2.out|err, ...
        return self.procs[rank]

    def start_all(self) -> None:
        for rank in range(len(HOSTS)):
            self.start(rank)

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, why: str) -> None:
        summary = self.run_dir / "summary.json"
        text = summary.read_text() if summary.exists() else "(no summary.json)"
        pytest.fail(f"{why} after {self.elapsed():.0f} s\nsummary: {text}\n{self.lab.report()}", pytrace=False)

    def wait_until(self, what: str, check, timeout: float, poll: float = 0.05):
        """Poll ``check()`` until it returns something true; fail naming ``what`` if a process
        exits meanwhile or ``timeout`` s pass. Returns what ``check`` returned."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            exited = [f"rank {r} exited {p.returncode}" for r, p in self.procs.items() if not p.alive]
            if exited:
                self.fail(f"waiting for {what}: {', '.join(exited)}")
            if time.monotonic() > deadline:
                self.fail(f"{what} did not happen within {timeout:.0f} s")
            time.sleep(poll)

    def committed(self) -> int:
        """Rounds the server's checkpoint holds (0: none yet)."""
        return self._rounds(self.run_dir / "checkpoints" / "last.pt")

    def saved(self, silo: int) -> int:
        """The newest round silo ``silo`` saved its state after (0: none yet)."""
        rounds = saved_rounds(self.run_dir / f"silo_{silo}" / "checkpoints")
        return max(rounds, default=-1) + 1

    def _rounds(self, path: Path) -> int:
        try:
            stat = path.stat()
        except FileNotFoundError:
            return 0
        key = (stat.st_ino, stat.st_mtime_ns)  # written atomically (a rename): a new file, a new key
        if self._seen.get(path, (None,))[0] != key:
            self._seen[path] = (key, load_checkpoint(path)["round"] + 1)  # "round": the last one's index
        return self._seen[path][1]

    def finish(self, bound: float) -> float:
        """Wait for every process to exit, at most until ``bound`` s after the job started; return
        the time the job took. Fails (with every process's output) on a timeout or a non-zero exit."""
        while any(p.alive for p in self.procs.values()):
            codes = {rank: p.returncode for rank, p in self.procs.items()}
            if any(codes.values()):  # one failed: the others would only wait for their timeouts
                self.fail(f"exit codes {codes} (None: still running)")
            if self.elapsed() > bound:
                self.fail(f"still running at the bound of {bound:.0f} s: exit codes {codes}")
            time.sleep(0.2)
        took = self.elapsed()
        codes = {rank: p.returncode for rank, p in self.procs.items()}
        if any(codes.values()):
            self.fail(f"exit codes {codes}")
        return took

    def assert_simulators_model(self) -> None:
        """The run completed with the simulator's final model and every round's test accuracy, and
        no process tried an address the lab does not have."""
        summary = json.loads((self.run_dir / "summary.json").read_text())
        assert summary["status"] == "completed", summary
        a = load_checkpoint(self.reference / "checkpoints" / "last.pt")["algorithm"]["global_state"]
        b = load_checkpoint(self.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
        assert by_round(self.run_dir) == by_round(self.reference)
        assert not self.record.exists(), self.record.read_text()


def test_a_one_second_link_and_a_slow_lossy_narrow_link(make_lab, tmp_path, job):
    """(a) silo 0's link: 1 s +- 100 ms one-way (2 s round trips, about 4-6 of them to open a TLS channel
    and send a message); (b) silo 1's link: 200 ms one-way, 5% loss each way and 256 kbit/s (tbf) each
    way. One job meets both (the test's time is the CI's)."""
    lab = make_lab(HOSTS, subnet=SUBNET)
    lab.link("silo0").set(delay=1.0, jitter=0.1)
    lab.link("silo1").set(delay=0.2, loss=0.05)
    lab.link("silo1").rate(256)
    run = Job(lab, job, tmp_path, "slow")
    run.start_all()
    took = run.finish(bound=240)
    run.assert_simulators_model()
    lost = sum(lab.link("silo1").stats()[d]["lost"] for d in ("up", "down"))
    assert lost > 0  # the loss did meet the job's traffic
    print(
        f"\n1 s one-way on silo 0's link, 200 ms + 5% loss + 256 kbit/s on silo 1's: {took:.1f} s, {lost} frames lost"
    )


def test_a_30_s_cut_of_one_silos_link_in_mid_round(make_lab, tmp_path, job):
    """(c) As soon as the server has committed round 1, silo 1's link drops everything for 30 s
    (round 2 is under way: its tasks are in flight or training); then it comes back."""
    lab = make_lab(HOSTS, subnet=SUBNET)
    run = Job(lab, job, tmp_path, "cut")
    run.start_all()
    run.wait_until("the server's checkpoint of round 1", lambda: run.committed() >= 1, timeout=150)
    cut = lab.link("silo1").cut(30.0)
    assert run.committed() == 1 and all(p.alive for p in run.procs.values())  # mid-run, in round 2
    took = run.finish(bound=200)
    stats = lab.link("silo1").stats()
    assert stats["up"]["cut"] + stats["down"]["cut"] > 0, stats  # the cut met the job's traffic
    run.assert_simulators_model()
    print(f"\n30 s cut at {cut['start'] - run.t0:.1f} s into the run: {took:.1f} s")


def test_a_silo_and_then_the_server_killed_and_restarted_alone(make_lab, tmp_path, job):
    """(e) Once round 1 is committed silo 1 is killed (SIGKILL) and, 1 s later, started again; the server
    and silo 0 keep running and it rejoins. (d) Once round 2 is committed the server is killed and, 1 s
    later, started again alone with --resume; the silos keep running and rejoin it."""
    lab = make_lab(HOSTS, subnet=SUBNET)
    run = Job(lab, job, tmp_path, "restarts")
    run.start_all()
    run.wait_until("the server's checkpoint of round 1", lambda: run.committed() >= 1, timeout=150)
    run.kill(2)
    time.sleep(1.0)
    run.start(2)
    run.wait_until("the server's checkpoint of round 2", lambda: run.committed() >= 2, timeout=150)
    run.kill(0)
    time.sleep(1.0)
    run.start(0, resume=True)
    took = run.finish(bound=240)
    run.assert_simulators_model()
    print(f"\na silo and then the server restarted: {took:.1f} s")


def test_a_failure_inside_a_checkpoint_round_resumes_on_every_process(make_lab, tmp_path, job):
    """(f) The server is killed the moment silo 0 has saved its state for a round the server has
    not yet committed (every round checkpoints); then every process is stopped and started again
    with --resume."""
    lab = make_lab(HOSTS, subnet=SUBNET)
    run = Job(lab, job, tmp_path, "ckpt_failure")
    run.start_all()

    def silo_ahead() -> tuple[int, int] | None:
        silo = run.saved(0)
        return (silo, run.committed()) if silo >= 2 and run.committed() < silo else None

    silo, server = run.wait_until("silo 0 saving a round the server has not committed", silo_ahead, 150, poll=0.01)
    run.kill(0)
    assert run.committed() == server, "the server committed silo 0's round before the kill: a slow poll"
    for rank in (1, 2):
        run.kill(rank)
    time.sleep(1.0)
    for rank in range(len(HOSTS)):
        run.start(rank, resume=True)
    took = run.finish(bound=200)
    run.assert_simulators_model()
    print(f"\nkilled with silo 0 after round {silo} and the server after round {server}, resumed: {took:.1f} s")
