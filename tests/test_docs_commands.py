"""Every command in README.md and docs/*.md runs, as written, on tiny settings.

The commands are the lines of the fenced ``bash`` / ``sh`` blocks (``\\`` continuations joined, a
quoted argument spanning lines, such as a ``python -c "..."`` script, is one command; shlex finds
where a command ends). Each is a test named ``FILE:LINE``. A file's commands run in document
order in one bash session, since they build on each other (``run`` then ``export runs/<name>``;
``partition --export /tmp/silos`` then ``mpirun ... /tmp/silos/deployment.yaml``; ``T=...`` then
``$T``), in a scratch folder per file (the working folder ``work/``, standing in for the
checkout, with ``home/`` and ``tmp/`` beside it). ``work/`` holds:

* copies of the checkout's ``configs/``, ``deploy/``, ``mobile_export/``, ``benchmarks/`` and
  ``.gitignore`` (copies, so that a command writing under them, e.g.
  ``deploy/make_test_certs.sh deploy/certs``, leaves the checkout alone);
* ``.venv/bin/`` with ``python`` (this interpreter), ``fedml-ssfl`` (``python -m fedml_ssfl``
  with this checkout on ``PYTHONPATH``) and an ``activate`` that puts them first on ``PATH``,
  which they already are (the interpreter's own folder, with ``mpirun`` and ``fedml``, follows);
* the user's own files a command names: unlabeled images (``unlabeled.npy``, ``unlabeled.npz``,
  ``batch.npz``, ``photos/``); and ``HOME`` is ``home/``, with a tiny CIFAR-10 in its real format
  where the paper configs' ``data_cache_dir`` points (``~/.cache/fedml_ssfl/data``).

Rewritten before running, and shown with the command on a failure: absolute ``/tmp/...`` paths
go into the scratch folder's ``tmp/``, and the few rules of :data:`RUN` that name a
stand-in (``scp FILES device:DIR``: the device is the scratch folder, so the files are copied
there). Every command must exit 0; a failure prints the command, its id and its output's tail.

Tiny settings without changing a command: ``FEDML_SSFL_SET`` (:data:`SMOKE`, honoured by
``fedml_ssfl.config.load_config`` in every process, mpirun's ranks included) replaces the
configs' round counts, steps and batch size and runs on the CPU; a ``--set`` the command gives
itself still wins. Silo and worker counts are left alone, so each ``mpirun -np`` still fits.

A command no rule of :data:`RUN` or :data:`EXCLUDED` covers fails
``test_every_doc_command_has_a_rule``, and an exclusion that covers no command fails
``test_every_exclusion_still_covers_a_command``: a new or changed doc command cannot go unrun
unnoticed. Identical commands in one file run once.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COPIED = ("configs", "deploy", "mobile_export", "benchmarks", ".gitignore")
TIMEOUT = 300  # seconds per command; a hung mpirun job fails its test instead of the whole run

SMOKE = " ".join(
    [
        "train_args.comm_round=2",
        "train_args.local_steps=2",
        "train_args.epochs=0",  # FedML's local epochs: T = local_steps instead
        "train_args.batch_size=16",
        "ssfl_args.server_steps=2",  # SemiFL's fine-tune, FedMatch's / FedSEAL's server steps
        "ssfl_args.bootstrap_steps=2",  # FedAvg-SSL's / FedSEAL's server bootstrap
        "ssfl_args.local_epochs=null",  # SemiFL / FedSiam: T steps instead of epochs
        "device_args.device=cpu",  # the paper configs name cuda
    ]
)
"""``FEDML_SSFL_SET`` for every command: every config a command loads is a two-round smoke run."""

EXCLUDED: dict[str, str] = {
    r"^python3(\.\d+)? -m venv .*pip install": "creates the venv and installs the package: CI's own install step",
    r"^python -m pytest\b": "the test suite itself: CI's test step",
    r"^mpirun .*--hostfile\b": "needs the machines its hostfile names (multi-host mpirun)",
    r"^deploy/start_(server|client)\.sh\b": (
        "GRPC across hosts, one process per machine at deploy/ipconfig.csv's addresses "
        "(tests/test_fedml_grpc.py runs a GRPC job on 127.0.0.1)"
    ),
    r"--rank 0 --role server\b": (
        "a GRPC server alone waits for its clients on other hosts (tests/test_fedml_grpc.py runs "
        "server and clients together on 127.0.0.1)"
    ),
    r"^fedml (login|launch)\b": "FedML's cloud (network, an account)",
    r"^(printf eid,rank,grpc_server_ip|S=--cf deploy/fedml_example/|for r in 1 2; do python deploy/fedml_example/)": (
        "a FedML script's GRPC job started by hand, three processes in the background (deploy_reference.md); "
        "tests/test_fedml_examples.py runs FedML's GRPC example with mutual TLS and the job key, stopped and resumed"
    ),
    r"^ssh device\b": "a device reached over ssh",
    r"^python benchmarks/round_speed\.py$": (
        "the full round-speed sweep (10 rows, ~45 min on 2 cores); its figures are committed in benchmarks/results/ "
        "and docs/performance.md's one-row --merge command runs here"
    ),
    r"^python benchmarks/stacked_clients\.py --device cuda\b": "needs a CUDA device (this CI has none)",
    r"^(python benchmarks/autocast_step\.py --device cuda|fedml-ssfl (bench|run) .*--set device_args\.device=cuda)\b": (
        "needs a CUDA device (this CI has none): docs/performance.md's GPU measurements"
    ),
    r"^python benchmarks/gpu_augment_check\.py$": (
        "needs a CUDA device (none here); tests/test_augment.py runs it with --device cpu"
    ),
    r"^python benchmarks/layout_step\.py\b": (
        "seven models' training steps in two layouts (two minutes here); its figures are committed in "
        "benchmarks/results/layout_step.json and tests/test_performance.py tests the choice it informs"
    ),
    r"^python benchmarks/compile_step\.py\b": (
        "compiles with inductor (20 s to a minute of C++ compilation here); tests/test_bench.py tests the bench's "
        "compile variant, and the figures are committed in benchmarks/results/compile_step.json"
    ),
    r"^python benchmarks/eval_batch\.py$": (
        "six models at five batch sizes in two layouts (~10 min here); its figures are committed in "
        "benchmarks/results/eval_batch.json and its one-model run runs here"
    ),
    r"^python benchmarks/state_memory\.py$": (
        "a benchmark sweep (K up to 10,000, minutes); its figures are committed in benchmarks/results/ and "
        "tests/test_client_state.py tests the store it measures"
    ),
}
"""Commands that cannot run here: regex (searched in the one-line command) -> why."""

RUN: dict[str, str | None] = {
    r"^fedml-ssfl\b": None,
    r"^mpirun -np \d+ --oversubscribe (fedml-ssfl|python deploy/[\w/]+\.py) ": None,  # FedML scripts in deploy/
    r"^deploy/(run_mpi|make_test_certs|build_launch)\.sh ": None,  # build_launch: FedML's build, offline
    r"^python (-c |-m mobile_export |edge_label\.py )": None,
    # smoke-sized by FEDML_SSFL_SET (round_speed, first_round) or by their own arguments
    r"^python benchmarks/(round_speed\.py --rows |first_round\.py |stacked_clients\.py --algorithms )": None,
    r"^python benchmarks/autocast_step\.py --steps ": None,  # CPU, its own step count (seconds)
    r"^python benchmarks/(augment_speed|max_pool)\.py --repeats ": None,  # CPU, seconds
    r"^python benchmarks/gpu_augment_check\.py --device cpu ": None,  # the parity script on the CPU, seconds
    r"^python benchmarks/semifl_overhead\.py --rounds ": None,  # smoke-sized by FEDML_SSFL_SET
    r"^python benchmarks/eval_batch\.py --models ": None,  # CPU, the models named (seconds)
    r"^python benchmarks/inplace_relu\.py --steps ": None,  # CPU, its own step and evaluation counts (seconds)
    r"^python benchmarks/round_speed\.py --replot$": None,  # draws the committed json again (seconds)
    r"^fedml federate build ": None,  # packs the workspace locally, offline
    r"^\. \.venv/bin/activate$": None,
    r"^export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1$": None,
    r"^T=": None,
    r"^printf .* > hosts$": None,
    r"^scp (?P<files>.+) device:\S*$": "cp {files} .",  # the device is the scratch folder
}
"""Commands run here: regex -> None (run as written) or a stand-in (``{group}`` from the match)."""


# ---------------------------------------------------------------------------------------------
# extraction


@dataclass(frozen=True)
class DocCommand:
    """One command of a fenced block: its file (relative to the checkout), first line and text."""

    file: str
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def words(self) -> str:
        """The command on one line, comments and quotes dropped: what the rules match."""
        return " ".join(shlex.split(re.sub(r"\\\n", " ", self.text), comments=True))


def _complete(text: str) -> bool:
    """Whether ``text`` is a whole shell command (no open quote, no trailing ``\\``)."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def extract_commands(path: Path, name: str) -> list[DocCommand]:
    """The commands of ``path``'s fenced bash / sh blocks, in document order."""
    out: list[DocCommand] = []
    in_block, pending, start = False, "", 0
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = line.strip().startswith("```")
        if not in_block:
            in_block = fence and line.strip()[3:].strip() in ("bash", "sh")
            continue
        if fence:
            if pending:
                raise ValueError(f"{name}:{start}: the command does not end before its block does")
            in_block = False
            continue
        if not pending:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pending, start = line, no
        else:
            pending += "\n" + line
        if _complete(pending):
            out.append(DocCommand(name, start, pending.strip()))
            pending = ""
    return out


def all_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in extract_commands(doc, doc.relative_to(ROOT).as_posix())]


def rule_for(cmd: DocCommand) -> tuple[str, str, re.Match]:
    """(``"excluded"`` or ``"run"``, the rule's pattern, its match); KeyError when none covers it."""
    for kind, table in (("excluded", EXCLUDED), ("run", RUN)):
        for pattern in table:
            m = re.search(pattern, cmd.words)
            if m:
                return kind, pattern, m
    raise KeyError(cmd.id)


def runnable(commands: list[DocCommand]) -> list[DocCommand]:
    """The commands to run: covered by a run rule, the first of identical ones in a file."""
    seen, out = set(), []
    for cmd in commands:
        try:
            kind = rule_for(cmd)[0]
        except KeyError:
            continue  # test_every_doc_command_has_a_rule fails
        if kind == "run" and (cmd.file, cmd.text) not in seen:
            seen.add((cmd.file, cmd.text))
            out.append(cmd)
    return out


def as_run(cmd: DocCommand, scratch: Path) -> str:
    """The shell text run for ``cmd``: a stand-in where its rule names one, ``/tmp/`` in ``scratch/tmp/``."""
    _, pattern, m = rule_for(cmd)
    text = RUN[pattern].format(**m.groupdict()) if RUN[pattern] else cmd.text
    return re.sub(r"(?<![\w.~/-])/tmp/", f"{scratch}/tmp/", text)


COMMANDS = all_commands()
RUNNABLE = runnable(COMMANDS)


# ---------------------------------------------------------------------------------------------
# the scratch folder and one bash session per file


def make_scratch(scratch: Path) -> None:
    """``work/`` (the checkout's folders, a venv's bin, the user's images), ``home/``, ``tmp/``, ``logs/``."""
    work, home = scratch / "work", scratch / "home"
    for name in ("work", "home", "tmp", "logs"):
        (scratch / name).mkdir()
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, work / name)
    bin_dir = work / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = shlex.quote(sys.executable)
    for name, body in (("python", f'exec {python} "$@"'), ("fedml-ssfl", f'exec {python} -m fedml_ssfl "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "activate").write_text(f'export VIRTUAL_ENV="{bin_dir.parent}" PATH="{bin_dir}:$PATH"\n')

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 1, 28, 28), dtype=np.uint8)  # the exported models' input
    np.save(work / "unlabeled.npy", images)
    np.savez(work / "unlabeled.npz", images=images)
    np.savez(work / "batch.npz", images=images, ids=np.array([f"s{i}" for i in range(len(images))]))
    from PIL import Image

    (work / "photos").mkdir()
    for i, img in enumerate(images[:3]):
        Image.fromarray(img[0]).save(work / "photos" / f"{i}.png")
    write_tiny_cifar10(home / ".cache" / "fedml_ssfl" / "data" / "cifar-10-batches-py", rng)


def write_tiny_cifar10(folder: Path, rng: np.random.Generator, per_batch: int = 240, test: int = 100) -> None:
    """CIFAR-10's python pickles (5 train batches, a test batch, the meta file), a few images each."""
    folder.mkdir(parents=True)

    def batch(n: int) -> dict:
        return {b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8), b"labels": [i % 10 for i in range(n)]}

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(per_batch)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(test)))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}))


@dataclass
class Outcome:
    """How a command ended: exit status, output, wall and CPU seconds (its processes'), the text run."""

    rc: int
    output: str
    seconds: float
    cpu: float
    ran: str


@dataclass
class DocShell:
    """One bash session in ``scratch/work``, running one doc file's commands in order."""

    scratch: Path
    commands: list[DocCommand]
    done: dict[str, Outcome] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    dead: str = ""

    def start(self) -> None:
        bin_dir = self.scratch / "work" / ".venv" / "bin"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDML_SSFL_")}
        env.pop("VIRTUAL_ENV", None)
        env.update(
            PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
            PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x),
            HOME=str(self.scratch / "home"),
            FEDML_SSFL_SET=SMOKE,
            FEDML_SSFL_ROUND_TIMEOUT="120",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMP_NUM_THREADS="1",
        )
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.scratch / "work",
            env=env,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends the session and all it started
        )

    def run_through(self, cmd: DocCommand) -> Outcome:
        """Run the file's commands up to ``cmd`` (those not run yet), return ``cmd``'s outcome."""
        for c in self.commands:
            if c.id not in self.done:
                self.done[c.id] = self._run(c)
            if c.id == cmd.id:
                return self.done[c.id]
        raise KeyError(cmd.id)

    def _run(self, cmd: DocCommand) -> Outcome:
        ran = as_run(cmd, self.scratch)
        if self.dead:
            return Outcome(-1, self.dead, 0.0, 0.0, ran)
        if self.proc is None:
            self.start()
        n = len(self.done)
        script, out, rc, cpu = (self.scratch / "logs" / f"{n}.{ext}" for ext in ("sh", "out", "rc", "cpu"))
        script.write_text(ran + "\n")
        started = time.perf_counter()
        self.proc.stdin.write(
            f"times > {cpu}.0; {{ . {script} ; }} > {out} 2>&1 < /dev/null; echo $? > {rc}.tmp; times > {cpu}.1; "
            f"mv {rc}.tmp {rc}\n"
        )
        self.proc.stdin.flush()
        while not rc.exists():
            if self.proc.poll() is not None:
                self.dead = f"the bash session ended (status {self.proc.returncode}) during {cmd.id}"
            elif time.perf_counter() - started > TIMEOUT:
                self.close()
                self.dead = f"{cmd.id} ran past {TIMEOUT} s and the session was ended"
            if self.dead:
                return Outcome(-1, _read(out) + "\n" + self.dead, time.perf_counter() - started, 0.0, ran)
            time.sleep(0.05)
        seconds = time.perf_counter() - started
        return Outcome(int(rc.read_text()), _read(out), seconds, _children_cpu(cpu, 1) - _children_cpu(cpu, 0), ran)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _children_cpu(path: Path, which: int) -> float:
    """User + system seconds of the session's finished children, from bash's ``times`` (its 2nd line)."""
    line = Path(f"{path}.{which}").read_text().splitlines()[1]
    return sum(int(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", line))


@pytest.fixture(scope="module")
def shells(tmp_path_factory):
    """A :class:`DocShell` per doc file, each in its own scratch folder, closed at the end."""
    made: dict[str, DocShell] = {}

    def get(file: str) -> DocShell:
        if file not in made:
            scratch = tmp_path_factory.mktemp(re.sub(r"\W", "_", file))
            make_scratch(scratch)
            made[file] = DocShell(scratch, [c for c in RUNNABLE if c.file == file])
        return made[file]

    yield get
    for shell in made.values():
        shell.close()


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("cmd", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_doc_command_runs(cmd, shells):
    shell = shells(cmd.file)
    result = shell.run_through(cmd)
    if result.rc != 0:
        earlier = [f"{c.id} (exit {o.rc})" for c, o in zip(shell.commands, shell.done.values()) if o.rc != 0]
        earlier = [e for e in earlier if not e.startswith(f"{cmd.id} ")]
        pytest.fail(
            f"{cmd.id} exited {result.rc} after {result.seconds:.0f} s\n--- as written:\n{cmd.text}\n"
            f"--- as run (in {shell.scratch / 'work'}):\n{result.ran}\n"
            + (f"--- earlier failures in {cmd.file}: {', '.join(earlier)}\n" if earlier else "")
            + f"--- output (tail):\n{result.output[-4000:]}",
            pytrace=False,
        )


def test_every_doc_command_has_a_rule():
    missing = []
    for cmd in COMMANDS:
        try:
            rule_for(cmd)
        except KeyError:
            missing.append(f"{cmd.id}: {cmd.words}")
    assert not missing, (
        "doc commands no rule covers; add a RUN rule (preferred) or an EXCLUDED reason in "
        "tests/test_docs_commands.py:\n" + "\n".join(missing)
    )


def test_every_exclusion_still_covers_a_command():
    stale = [p for p in EXCLUDED if not any(re.search(p, c.words) for c in COMMANDS)]
    assert not stale, f"EXCLUDED patterns no doc command matches any more (remove them): {stale}"


def test_extraction_joins_continuations_and_multiline_quotes(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(
        "text\n```bash\n# a comment\nfedml-ssfl run \\\n  --set a.b=1   # it's a comment\n\n"
        'python -c "\nimport os\nprint(1)"\nfedml-ssfl partition --export /tmp/x\n```\n'
        "```python\nprint(2)\n```\n```sh\necho hi\n```\n"
    )
    cmds = extract_commands(doc, "d.md")
    assert [(c.line, c.words) for c in cmds] == [
        (4, "fedml-ssfl run --set a.b=1"),
        (7, "python -c \nimport os\nprint(1)"),
        (10, "fedml-ssfl partition --export /tmp/x"),
        (16, "echo hi"),
    ]
    assert as_run(cmds[2], tmp_path) == f"fedml-ssfl partition --export {tmp_path}/tmp/x"
    with pytest.raises(KeyError):  # a command no rule covers (test_every_doc_command_has_a_rule lists it)
        rule_for(cmds[3])
    doc.write_text('```bash\npython -c "\nprint(1)\n```\n')
    with pytest.raises(ValueError, match="d.md:2"):
        extract_commands(doc, "d.md")
