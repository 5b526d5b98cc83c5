"""deploy/: the mpirun launcher computes -np and passes hostfile / GPU mapping; the GPU mapping,
ipconfig and start scripts are consistent with the configs; job.yaml parses with FedML's own
launch-YAML parser, offline.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
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
    # every file the job's commands use exists in the workspace, and its config is a GRPC job
    for text in (job.server_job_on_posix, job.commands_on_posix):
        for token in shlex.split(text.replace('"', "")):
            if token.startswith(("deploy/", "configs/")):
                assert (ROOT / token).is_file(), token
    cfg = load_config(ROOT / "configs/fedml/mnist5k_grpc.yaml")
    assert cfg.comm_args.backend == "GRPC" and cfg.common_args.training_type == "cross_silo"
