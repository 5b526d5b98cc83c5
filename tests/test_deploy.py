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


def test_job_yaml_parses_with_fedmls_launch_parser_offline(tmp_path, monkeypatch):
    pytest.importorskip("fedml")
    record = tmp_path / "net.log"
    monkeypatch.setenv(offline.RECORD_ENV, str(record))
    monkeypatch.delenv(offline.ALLOW_ENV, raising=False)
    offline.install()
    try:
        from fedml.computing.scheduler.scheduler_entry.constants import Constants
        from fedml.computing.scheduler.scheduler_entry.launch_manager import FedMLJobConfig

        job = FedMLJobConfig(str(DEPLOY / "job.yaml"))
    finally:
        offline.uninstall()
    assert not record.exists(), record.read_text()
    assert Path(job.executable_file_folder).resolve() == ROOT  # workspace: the repository
    assert job.task_type == Constants.JOB_TASK_TYPE_FEDERATE and job.using_easy_mode
    assert "pip install -e ." in job.bootstrap_on_posix
    assert "start_server.sh" in job.server_job_on_posix and "start_client.sh" in job.commands_on_posix
    assert "$FEDML_CLIENT_RANK" in job.commands_on_posix
    # every file the job's commands use exists in the workspace, and its config is a GRPC deployment
    configs = set()
    for text in (job.server_job_on_posix, job.commands_on_posix):
        for token in shlex.split(text.replace('"', "")):
            if token.startswith(("deploy/", "configs/")):
                assert (ROOT / token).is_file(), token
                configs |= {token} if token.endswith(".yaml") else set()
    assert configs == {"configs/fedml/launch_deployment.yaml"}
    cfg = load_config(ROOT / "configs/fedml/launch_deployment.yaml")
    assert cfg.comm_args.backend == "GRPC" and cfg.common_args.training_type == "cross_silo"
    assert cfg.comm_args.mode == "deployment"  # each machine reads only its own data
    c, d = cfg.comm_args, cfg.data_args
    for path in (c.tls_ca, c.tls_cert, c.tls_key, c.job_key_file, d.local_data, d.server_data, d.test_data):
        assert path.startswith("~/.fedml_ssfl/"), path  # provisioned on each machine, not in the package


PRIVATE_KEY = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBkQ\n-----END EC PRIVATE KEY-----\n"
PACKED_TOP = {"fedml_ssfl", "mobile_export", "configs", "deploy", "setup.py", "README.md", ".gitignore", "pytest.ini"}
PACKED_TOP |= {"ruff.toml", "config"}  # config: FedML's own copy of the job's config


@pytest.fixture
def repo_copy(tmp_path):
    """The checkout's files in a fresh git repository, plus what a working copy holds that must never ship."""
    # the checkout as a working copy has it, minus git's own folder and what is heavy and ignored anyway
    heavy = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info")
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=heavy)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"],
    ):
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
    for name, text in {
        ".venv/lib/python3.11/site-packages/torch/big.py": "VENV_FILE_MARKER = 1\n",
        "runs/old_run/checkpoints/last.pt": "RUN_FILE_MARKER",
        "deploy/certs/ca.pem": "-----BEGIN CERTIFICATE-----\n",
        "deploy/certs/rank0.key": PRIVATE_KEY,
        "deploy/certs/job.key": "ab" * 32 + "\n",
        "job.key": "cd" * 32 + "\n",
    }.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    return repo


def _build_env(tmp_path, site: Path) -> dict[str, str]:
    env = dict(os.environ, HOME=str(tmp_path / "home"), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(site), str(ROOT), env.get("PYTHONPATH", "")) if x)
    env["SSFL_TEST_NET_RECORD"] = str(tmp_path / "net.log")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def test_fedmls_own_build_packs_the_job_and_no_key_venv_run_or_test(repo_copy, tmp_path):
    """`fedml federate build deploy/job.yaml`: FedML's CLI, offline, on a working copy with a venv, runs and keys."""
    from tests.test_fedml_mpi import SITECUSTOMIZE

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)  # records and refuses any socket leaving this host
    out = tmp_path / "packages"
    proc = subprocess.run(
        [str(BIN / "fedml"), "federate", "build", "deploy/job.yaml", "-d", str(out)],
        cwd=repo_copy,
        capture_output=True,
        text=True,
        timeout=300,
        env=_build_env(tmp_path, site),
    )
    assert proc.returncode == 0 and "client package file" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (tmp_path / "net.log").exists(), (tmp_path / "net.log").read_text()
    listed = subprocess.run(
        [sys.executable, "deploy/launch_files.py", "deploy/job.yaml", "--list"],
        cwd=repo_copy,
        capture_output=True,
        text=True,
    ).stdout.split()
    for kind in ("client", "server"):
        with zipfile.ZipFile(out / f"{kind}-package.zip") as zf:
            infos = [i for i in zf.infolist() if not i.is_dir()]
            workspace = [i.filename.split("/", 2)[2] for i in infos if i.filename.startswith(f"{kind}-package/fedml/")]
            top = {name.split("/")[0] for name in workspace}
            assert top - {n for n in top if n.startswith("fedml_") and n.endswith((".sh", ".bat"))} == PACKED_TOP, top
            assert {"fedml_ssfl/runtime/fedml/hooks.py", "configs/fedml/launch_deployment.yaml"} <= set(workspace)
            ours = {n for n in workspace if not n.startswith(("config/", "fedml_")) or n.startswith("fedml_ssfl/")}
            assert ours == set(listed)  # deploy/launch_files.py reads exactly the files FedML packs
            assert not any(n.endswith((".key", ".pem", ".p12", ".pt")) or "/certs/" in n for n in workspace)
            planted = (PRIVATE_KEY.encode(), b"ab" * 32, b"cd" * 32, b"RUN_FILE_MARKER", b"VENV_FILE_MARKER")
            assert not [(i.filename, m) for i in infos for m in planted if m in zf.read(i)]
            assert sum(i.file_size for i in infos) < 4 * 2**20 and len(infos) < 400  # the job, not the repository
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo_copy, capture_output=True, text=True
    ).stdout
    assert status == "", status  # what the build leaves behind (deploy/launch_config) is git-ignored


def test_the_documented_build_refuses_a_private_key_under_any_name(repo_copy, tmp_path):
    """deploy/build_launch.sh reads every file FedML would pack and stops at one that holds a key."""
    out = tmp_path / "packages"
    env = _build_env(tmp_path, tmp_path)
    for name, text in (("configs/fedml/notes.txt", PRIVATE_KEY), ("deploy/secret.txt", "ef" * 32)):
        (repo_copy / name).write_text(text)
        proc = subprocess.run(
            ["bash", "deploy/build_launch.sh", str(out)],
            cwd=repo_copy,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and not out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
        assert lines[-1].startswith(f"fedml-ssfl: error: build_launch.sh: refusing to build: {name} would be packed")
        (repo_copy / name).unlink()
