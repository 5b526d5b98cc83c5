"""deploy/: the mpirun launcher computes -np and passes hostfile / GPU mapping; the GPU mapping,
ipconfig and start scripts are consistent with the configs; job.yaml parses with FedML's own
launch-YAML parser, offline, and FedML's own build packs only what the job needs (no key, no venv).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from fedml_ssfl.config import load_config
from fedml_ssfl.runtime import offline
from fedml_ssfl.runtime.fedml.launch import gpu_for_rank, read_ipconfig, world_size

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, DRY_RUN="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **env)
    return subprocess.run(
        ["bash", str(DEPLOY / name), *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=environ
    )


def test_run_mpi_computes_np_and_passes_hostfile_and_gpu_mapping():
    res = script(
        "run_mpi.sh",
        "configs/fedml/mnist5k_mpi.yaml",
        "--hostfile",
        "deploy/hostfile.example",
        "--gpu-mapping",
        "deploy/gpu_mapping.yaml",
        "--gpu-key",
        "mapping_2hosts_2gpus_c5",
        "--set",
        "train_args.comm_round=2",
    )
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    assert Path(cmd[0]).name == "mpirun" and cmd[cmd.index("-np") + 1] == "6"  # C_k = 5, + server
    assert cmd[cmd.index("--hostfile") + 1] == "deploy/hostfile.example"
    assert Path(cmd[cmd.index("run") - 1]).name == "fedml-ssfl" and "--cf" in cmd
    sets = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]
    assert "device_args.device=cuda" in sets and "device_args.gpu_mapping_key=mapping_2hosts_2gpus_c5" in sets
    assert "train_args.comm_round=2" in sets
    # overrides change -np too, and one host with too few cores gets --oversubscribe
    res = script("run_mpi.sh", "configs/fedml/digits_tiny_mpi.yaml", "--set", "train_args.client_num_per_round=4")
    cmd = shlex.split(res.stdout)
    assert res.returncode == 0 and cmd[cmd.index("-np") + 1] == "5"
    assert ("--oversubscribe" in cmd) == (5 > (os.cpu_count() or 1))


def test_run_mpi_refuses_a_mapping_or_backend_that_does_not_fit():
    res = script(
        "run_mpi.sh",
        "configs/fedml/digits_tiny_mpi.yaml",
        "--gpu-mapping",
        "deploy/gpu_mapping.yaml",
        "--gpu-key",
        "mapping_1host_4gpus_c5",
    )
    assert res.returncode != 0 and "places 6 processes, but the job has C_k + 1 = 3" in res.stderr
    res = script("run_mpi.sh", "configs/fedml/mnist5k_grpc.yaml")
    assert res.returncode != 0 and "comm_args.backend MPI" in res.stderr


def test_gpu_mapping_pins_every_rank_of_the_configs_it_names():
    mapping = yaml.safe_load((DEPLOY / "gpu_mapping.yaml").read_text())
    sizes = {"c2": 3, "c5": 6}
    for key, hosts in mapping.items():
        world = sizes[key.rsplit("_", 1)[1]]
        gpus = [gpu_for_rank(DEPLOY / "gpu_mapping.yaml", key, r, world) for r in range(world)]
        assert len(gpus) == world and all(0 <= g < max(len(v) for v in hosts.values()) for g in gpus)
    assert [gpu_for_rank(DEPLOY / "gpu_mapping.yaml", "mapping_1host_4gpus_c5", r, 6) for r in range(6)] == [
        0,
        0,
        1,
        1,
        2,
        3,
    ]
    assert world_size(load_config(ROOT / "configs/fedml/mnist5k_mpi.yaml")) == 6
    # the hostfile example has as many slots as mnist5k_mpi.yaml has processes
    slots = [
        int(x.split("slots=")[1])
        for x in (DEPLOY / "hostfile.example").read_text().splitlines()
        if x.strip() and not x.startswith("#")
    ]
    assert sum(slots) == 6


def test_grpc_ipconfig_and_start_scripts_fit_the_grpc_config():
    cfg = load_config(ROOT / "configs/fedml/mnist5k_grpc.yaml")
    table = read_ipconfig(ROOT / cfg.comm_args.grpc_ipconfig_path)
    assert sorted(table) == list(range(world_size(cfg)))
    header = (DEPLOY / "ipconfig.csv").read_text().splitlines()[0]
    assert header == "eid,rank,grpc_server_ip,grpc_server_port"  # FedML's GRPC reader's columns
    server = shlex.split(script("start_server.sh", "configs/fedml/mnist5k_grpc.yaml", "deploy/ipconfig.csv").stdout)
    assert server[-6:-2] == ["--rank", "0", "--role", "server"]
    client = shlex.split(
        script("start_client.sh", "configs/fedml/mnist5k_grpc.yaml", "2", "deploy/ipconfig.csv").stdout
    )
    assert ["--rank", "2", "--role", "client"] == client[client.index("--rank") : client.index("--rank") + 4]
    assert "comm_args.grpc_ipconfig_path=deploy/ipconfig.csv" in client
    assert script("start_client.sh", "configs/fedml/mnist5k_grpc.yaml", "0").returncode == 2


JOBS = {"package": DEPLOY / "job.yaml", "script": DEPLOY / "launch_script" / "job.yaml"}
"""The launch jobs: the package's own GRPC deployment, and the template for a user's FedMLRunner script."""


def listed(job: Path, cwd: Path = ROOT) -> list[str]:
    """``deploy/launch_files.py JOB --list``: the files staging writes into the job's workspace."""
    proc = subprocess.run(
        [sys.executable, "deploy/launch_files.py", str(job), "--list"], cwd=cwd, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("kind", sorted(JOBS))
def test_job_yaml_parses_with_fedmls_launch_parser_offline(kind, tmp_path, monkeypatch):
    pytest.importorskip("fedml")
    record = tmp_path / "net.log"
    monkeypatch.setenv(offline.RECORD_ENV, str(record))
    monkeypatch.delenv(offline.ALLOW_ENV, raising=False)
    offline.install()
    try:
        from fedml.computing.scheduler.scheduler_entry.constants import Constants
        from fedml.computing.scheduler.scheduler_entry.launch_manager import FedMLJobConfig

        job = FedMLJobConfig(str(JOBS[kind]))
    finally:
        offline.uninstall()
    assert not record.exists(), record.read_text()
    # FedML packs the staged workspace beside the job YAML, never the repository
    assert Path(job.gitignore_file).parent == JOBS[kind].parent / "launch_workspace"  # (FedML: workspace/.gitignore)
    assert job.task_type == Constants.JOB_TASK_TYPE_FEDERATE and job.using_easy_mode
    assert "pip install ./fedml_ssfl_src" in job.bootstrap_on_posix
    assert "$FEDML_CLIENT_RANK" in job.commands_on_posix
    assert "--role client" in job.commands_on_posix or "start_client.sh" in job.commands_on_posix
    assert "--rank 0 --role server" in job.server_job_on_posix or "start_server.sh" in job.server_job_on_posix
    # every file the job's commands use is on its allow-list, and its config is a GRPC deployment with TLS
    files, configs = set(listed(JOBS[kind])), set()
    for text in (job.server_job_on_posix, job.commands_on_posix):
        for token in shlex.split(text.replace('"', "")):
            if token.startswith(("deploy/", "configs/")):
                assert token in files, token
                configs |= {token} if token.endswith(".yaml") else set()
    assert len(configs) == 1, configs
    cfg = load_config(ROOT / configs.pop())
    assert cfg.comm_args.backend == "GRPC" and cfg.common_args.training_type == "cross_silo"
    assert cfg.comm_args.grpc_ipconfig_path in files
    c, d = cfg.comm_args, cfg.data_args
    for path in (c.tls_ca, c.tls_cert, c.tls_key, c.job_key_file):
        assert path.startswith("~/.fedml_ssfl/"), path  # provisioned on each machine, not in the package
    if kind == "package":
        assert cfg.comm_args.mode == "deployment"  # each machine reads only its own data
        assert all(p.startswith("~/.fedml_ssfl/") for p in (d.local_data, d.server_data, d.test_data))


KEY_LINE = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQ"


def _pem(kind: str, marker: str) -> str:
    body = "\n".join([KEY_LINE, marker])
    return f"-----BEGIN {kind}PRIVATE KEY-----\n{body}\n-----END {kind}PRIVATE KEY-----\n"


SEEDS = {
    # what a working user's checkout holds and no package may carry: each file holds "SEEDED<n>"
    "venv/pyvenv.cfg": "home = /usr/bin\nversion = 3.11.0\n# SEEDED01\n",
    "venv/lib/python3.11/site-packages/torch/big.py": "SEEDED02 = 1\n",
    "data/silo_0.npz": "SEEDED03",
    ".env": "FEDML_API_KEY=sk-SEEDED04\nWANDB_API_KEY=SEEDED05\n",
    "id_ed25519": _pem("OPENSSH ", "SEEDED06"),
    "secrets/token.json": '{"token": "SEEDED07"}',
    "wandb/run-20260101_000000-abc/files/config.yaml": "SEEDED08: 1\n",
    "mlruns/0/meta.yaml": "artifact_location: SEEDED09\n",
    "runs/old_run/checkpoints/last.pt": "SEEDED10",
    "server.pem": _pem("", "SEEDED11"),
    "hf_token": "hf_SEEDED12\n",
    "deploy/certs/rank0.key": _pem("EC ", "SEEDED13"),
    "job.key": "cd" * 32 + "\n",
    # ... inside the folders a job does use: not on the allow-list, so never staged either
    "fedml_ssfl/.env": "API_KEY=SEEDED14\n",
    "fedml_ssfl/runtime/id_rsa": _pem("RSA ", "SEEDED15"),
    "fedml_ssfl/data/silo_1.npz": "SEEDED16",
    "configs/fedml/secret.yaml": "api_key: SEEDED17\n",
    "deploy/launch_script/.env": "TOKEN=SEEDED18\n",
    "deploy/fedml_example/data/digits.csv": "SEEDED19",
    # left in a workspace from an earlier hand edit: staging deletes it
    "deploy/launch_workspace/notes.txt": "SEEDED20",
    "deploy/launch_script/launch_workspace/deploy/old.txt": "SEEDED21",
}
SEEDED = (b"SEEDED", b"cd" * 32, KEY_LINE.encode())  # the markers, the job key, the private keys' body
SEEDED_TOP = {"venv", "data", "secrets", "wandb", "mlruns", "runs", "certs", ".env", "id_ed25519", "hf_token"}
FEDML_OWN = ("config/", "launch_config/")  # what FedML's build adds to a workspace (with fedml_*.sh / .bat)


@pytest.fixture
def clean_clone(tmp_path):
    """A `git clone` of the checkout's tracked files: the repository as a user clones it."""
    src, clone = tmp_path / "src", tmp_path / "clone"
    if (ROOT / ".git").exists():
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for rel in filter(None, names.decode().split("\0")):
            if (ROOT / rel).is_file():
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, src / rel)
    else:  # a copy of tracked files already (tests/mutants.yaml runs here)
        heavy = shutil.ignore_patterns(".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info")
        shutil.copytree(ROOT, src, ignore=heavy)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*git, "commit", "-qm", "checkout"]):
        subprocess.run(cmd, cwd=src, check=True, capture_output=True)
    subprocess.run(["git", "clone", "-q", str(src), str(clone)], check=True, capture_output=True)
    return clone


@pytest.fixture
def seeded_clone(clean_clone):
    for name, text in SEEDS.items():
        (clean_clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clean_clone / name).write_text(text)
    return clean_clone


def _build_env(tmp_path) -> dict[str, str]:
    """FedML's CLI offline: HOME in tmp, and a sitecustomize that records and refuses any socket leaving this host."""
    from tests.test_fedml_mpi import SITECUSTOMIZE

    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, HOME=str(tmp_path / "home"), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(site), env.get("PYTHONPATH", "")) if x)
    env["SSFL_TEST_NET_RECORD"] = str(tmp_path / "net.log")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(cmd: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=_build_env(tmp_path))
    assert not (tmp_path / "net.log").exists(), (tmp_path / "net.log").read_text()
    return proc


def _packed(out: Path) -> dict[str, dict[str, bytes]]:
    """Each package's workspace files (path inside the workspace -> content), from FedML's zips in ``out``."""
    found = {}
    for kind in ("client", "server"):
        with zipfile.ZipFile(out / f"{kind}-package.zip") as zf:
            prefix = f"{kind}-package/fedml/"
            found[kind] = {
                i.filename[len(prefix) :]: zf.read(i)
                for i in zf.infolist()
                if not i.is_dir() and i.filename.startswith(prefix)
            }
    return found


def _check_packages(out: Path, allowed: list[str], *, every: bool = True) -> None:
    """No seeded name or content in either package; its workspace files are the allow-list (``every``: all)."""
    for kind, files in _packed(out).items():
        mine = {n for n in files if not n.startswith(FEDML_OWN) and not ("/" not in n and n.startswith("fedml_"))}
        if every:
            assert mine == set(allowed), (kind, sorted(mine ^ set(allowed)))
        assert mine <= set(allowed), (kind, sorted(mine - set(allowed)))
        assert not [n for n in files if n in SEEDS or n.split("/")[0] in SEEDED_TOP], kind
        assert not [(n, m) for n, data in files.items() for m in SEEDED if m in data]
        assert sum(len(d) for d in files.values()) < 3 * 2**20  # the job, not the repository


def test_build_launch_works_on_a_clean_clone_and_packs_exactly_the_allow_list(clean_clone, tmp_path):
    """`deploy/build_launch.sh` on a fresh clone: staging, the key check (the package's own source holds the
    words of a PEM header in an error message: not a key) and FedML's own build, offline."""
    out = tmp_path / "packages"
    proc = _run(["bash", "deploy/build_launch.sh", str(out)], clean_clone, tmp_path)
    assert proc.returncode == 0 and "client package file" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    allowed = listed(DEPLOY / "job.yaml", clean_clone)
    assert {"configs/fedml/launch_deployment.yaml", "deploy/start_server.sh", "deploy/start_client.sh"} <= set(allowed)
    assert {"fedml_ssfl_src/setup.py", "fedml_ssfl_src/fedml_ssfl/runtime/fedml/tls_files.py"} <= set(allowed)
    _check_packages(out, allowed)
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=clean_clone, capture_output=True, text=True
    ).stdout
    assert status == "", status  # the staged workspace and what FedML's build leaves behind are git-ignored


@pytest.mark.parametrize("kind", sorted(JOBS))
def test_no_secret_of_a_working_checkout_reaches_a_launch_package(kind, seeded_clone, tmp_path):
    """A checkout holding a venv named venv/, data/, .env, an extensionless ssh key, secrets/, wandb/, mlruns/,
    runs/, a *.pem, a token file (and more inside the packed folders): the packages hold none of it."""
    job = str(JOBS[kind].relative_to(ROOT))
    out = tmp_path / "packages"
    proc = _run(["bash", "deploy/build_launch.sh", job, str(out)], seeded_clone, tmp_path)
    assert proc.returncode == 0 and "client package file" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    allowed = listed(seeded_clone / job, seeded_clone)
    _check_packages(out, allowed)
    assert [n for n in allowed if not n.startswith("fedml_ssfl_src/")] == sorted(
        x.split("#")[0].strip()
        for x in (seeded_clone / job).with_name("job_files.txt").read_text().splitlines()
        if x.split("#")[0].strip() and not x.startswith("root:")
    )
    if kind == "script":
        return
    # `fedml launch` packs with FedML's own code again: the staged workspace, the same files
    again = tmp_path / "again"
    proc = _run([str(BIN / "fedml"), "federate", "build", job, "-d", str(again)], seeded_clone, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _check_packages(again, allowed)


def test_fedmls_own_build_of_an_unstaged_job_packs_nothing_of_the_checkout(seeded_clone, tmp_path):
    """`fedml federate build` / `fedml launch` before any staging: FedML packs an empty folder, not the repository
    (and the job's bootstrap stops on the platform, naming build_launch.sh)."""
    shutil.rmtree(seeded_clone / "deploy" / "launch_workspace")
    out = tmp_path / "packages"
    proc = _run([str(BIN / "fedml"), "federate", "build", "deploy/job.yaml", "-d", str(out)], seeded_clone, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _check_packages(out, [], every=True)
    assert (
        "run deploy/build_launch.sh before fedml launch"
        in yaml.safe_load((DEPLOY / "job.yaml").read_text())["bootstrap"]
    )


def test_the_documented_build_refuses_a_private_key_on_the_allow_list(clean_clone, tmp_path):
    """A listed file that holds a key (a PEM block in a config, a job key under any name) stops the build."""
    out = tmp_path / "packages"
    allow = clean_clone / "deploy" / "job_files.txt"
    listing = allow.read_text()
    config = clean_clone / "configs" / "fedml" / "launch_deployment.yaml"
    text = config.read_text()
    for name, write in (
        ("configs/fedml/launch_deployment.yaml", lambda: config.write_text(text + "# " + _pem("EC ", "x"))),
        ("deploy/job_token.txt", lambda: (clean_clone / "deploy/job_token.txt").write_text("ef" * 32)),
    ):
        write()
        allow.write_text(listing + f"{name}\n")
        proc = _run(["bash", "deploy/build_launch.sh", str(out)], clean_clone, tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and not out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
        assert lines[-1].startswith(f"fedml-ssfl: error: build_launch.sh: refusing to build: {name} would be packed")
        config.write_text(text)
        allow.write_text(listing)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("../outside.py", "without .."),
        ("deploy/no_such_script.py", "no such file"),
        ("fedml_ssfl_src/setup.py", "fedml_ssfl_src/ is the package's place"),
    ],
)
def test_a_bad_allow_list_line_is_one_error_naming_it(line, says, clean_clone):
    (clean_clone / "deploy" / "job_files.txt").open("a").write(f"{line}\n")
    proc = subprocess.run(
        [sys.executable, "deploy/launch_files.py", "deploy/job.yaml", "--stage"],
        cwd=clean_clone,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "job_files.txt line " in proc.stderr and line in proc.stderr and says in proc.stderr, proc.stderr


def test_staging_refuses_a_workspace_that_is_not_its_own_folder(clean_clone):
    """--stage deletes the workspace first: a job whose workspace is the repository is refused, nothing deleted."""
    job = clean_clone / "deploy" / "job.yaml"
    job.write_text(job.read_text().replace("workspace: launch_workspace", "workspace: .."))
    proc = subprocess.run(
        [sys.executable, "deploy/launch_files.py", "deploy/job.yaml", "--stage"],
        cwd=clean_clone,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "workspace: '..': must be launch_workspace" in proc.stderr, proc.stderr
    assert (clean_clone / "setup.py").is_file()
