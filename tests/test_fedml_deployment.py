"""FedML's deployment mode under ``mpirun``: each silo reads only its own file and keeps its own state.

A simulation split is materialised as per-silo npz files (``fedml-ssfl partition --export``); the
deployment run on them must end with the local simulator's model and test metrics for the same
seed, while every process opens only its own data files (recorded at interpreter start by a
``sitecustomize``), and a stopped deployment run resumes from the server's checkpoint and the
silos' own state files to the same end.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.experiment import export_deployment
from fedml_ssfl.runtime.local import run_local
from tests.conftest import SMALL
from tests.test_fedml_mpi import CLI, metrics, mpi_env, mpirun

pytest.importorskip("fedml")

# Records, per MPI rank, every file a process opens under the exported data folder.
OPEN_RECORDER = textwrap.dedent(
    """
    import builtins, io, os

    _root = os.environ["SSFL_TEST_DATA_ROOT"]
    _log = os.path.join(os.environ["SSFL_TEST_OPEN_LOG"], "rank%s.log" % os.environ.get("OMPI_COMM_WORLD_RANK", "x"))
    _open = builtins.open

    def _recording_open(file, *args, **kwargs):
        try:
            path = os.path.abspath(os.fspath(file))
        except TypeError:
            path = ""
        if path.startswith(_root):
            with _open(_log, "a") as fh:
                fh.write(path + "\\n")
        return _open(file, *args, **kwargs)

    builtins.open = io.open = _recording_open
    """
)

SETTINGS = [
    *SMALL,
    "train_args.client_num_in_total=3",
    "train_args.client_num_per_round=2",  # one silo idles every round
    "train_args.comm_round=3",
    "ssfl_args.algorithm=fedavg_ssl",
    "ssfl_args.threshold=0.5",
    "ssfl_args.bootstrap_steps=30",  # pseudo-labels flow from round 0, so the clients' momentum state matters
    "device_args.num_threads=1",
]


def simulation_config(tmp: Path):
    return load_config(None, [*SETTINGS, f"common_args.output_dir={tmp / 'runs'}", "common_args.run_name=sim"])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deployment")
    sim = simulation_config(tmp)
    data = tmp / "data"
    config = export_deployment(sim, data)
    site, opened = tmp / "site", tmp / "opened"
    site.mkdir()
    opened.mkdir()
    (site / "sitecustomize.py").write_text(OPEN_RECORDER)
    env = mpi_env(SSFL_TEST_DATA_ROOT=str(data.resolve()), SSFL_TEST_OPEN_LOG=str(opened))
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    full = mpirun(4, [str(CLI), "run", "--cf", str(config)], env=env)
    local = run_local(sim, run_dir=tmp / "local")
    return {"tmp": tmp, "sim": sim, "config": config, "data": data, "full": full, "local": local, "opened": opened}


def _run_dir(deployment, name: str | None = None) -> Path:
    cfg = load_config(deployment["config"])
    return cfg.run_dir() if name is None else cfg.run_dir().parent / name


def test_the_export_writes_one_file_per_silo_and_the_servers(deployment):
    data = deployment["data"]
    assert sorted(p.name for p in data.glob("*.npz")) == [
        "server.npz",
        "silo_0.npz",
        "silo_1.npz",
        "silo_2.npz",
        "test.npz",
    ]
    cfg = load_config(deployment["config"])
    assert cfg.comm_args.mode == "deployment" and cfg.data_args.local_data.endswith("silo_{silo}.npz")
    with __import__("numpy").load(data / "silo_0.npz") as f:
        assert (f["labels"] == -1).all()  # labels-at-server: the silo's labels are not in its file


def test_deployment_ends_with_the_simulators_model_and_metrics(deployment):
    proc = deployment["full"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir, local = _run_dir(deployment), deployment["local"]
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    for k, v in a["algorithm"]["global_state"].items():
        assert float((v - b["algorithm"]["global_state"][k]).abs().max()) < 1e-5, k
    sim_rows, dep_rows = metrics(local.run_dir), metrics(run_dir)
    assert [r["test_acc"] for r in sim_rows] == [r["test_acc"] for r in dep_rows]
    assert [(r["bytes_up"], r["bytes_down"]) for r in sim_rows] == [(r["bytes_up"], r["bytes_down"]) for r in dep_rows]
    assert [r["client_mask_rate"] for r in sim_rows] == pytest.approx([r["client_mask_rate"] for r in dep_rows])
    # the pseudo-label accuracy needs the silos' hidden labels: absent in deployment, present in simulation
    assert any("client_pseudo_acc" in r for r in sim_rows)
    assert not any("client_pseudo_acc" in r for r in dep_rows)
    # each silo's client state stayed on the silo, equal to the simulator's
    assert b["client_states"] == {}
    for silo, state in a["client_states"].items():
        saved = load_checkpoint(run_dir / f"silo_{silo}" / "checkpoints" / "silo_state-3.pt")
        assert saved["round"] == 2 and saved["silo"] == silo
        assert state.keys() == saved["state"].keys()
        for name, t in state.get("momentum", {}).items():
            assert torch.allclose(t, saved["state"]["momentum"][name], atol=1e-6), (silo, name)


def test_no_process_opens_another_silos_file(deployment):
    assert deployment["full"].returncode == 0
    data, opened = deployment["data"].resolve(), deployment["opened"]
    # every rank reads the shared deployment.yaml; the data files are what must stay apart
    seen = {int(p.stem[4:]): {f for f in p.read_text().split() if f.endswith(".npz")} for p in opened.glob("rank*.log")}
    assert seen[0] == {str(data / "server.npz"), str(data / "test.npz")}, seen[0]
    for rank in (1, 2, 3):
        assert seen[rank] == {str(data / f"silo_{rank - 1}.npz")}, (rank, seen[rank])


def test_a_stopped_deployment_resumes_to_the_same_end(deployment):
    config, env = deployment["config"], mpi_env()
    name = ["--set", "common_args.run_name=resumed"]
    first = mpirun(4, [str(CLI), "run", "--cf", str(config), *name, "--stop-after", "2"], env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = _run_dir(deployment, "resumed")
    assert [r["round"] for r in metrics(run_dir)] == [1, 2]
    second = mpirun(4, [str(CLI), "run", "--cf", str(config), *name, "--resume", str(run_dir)], env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    a = load_checkpoint(_run_dir(deployment) / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["test_acc"] for r in metrics(run_dir)] == [r["test_acc"] for r in metrics(_run_dir(deployment))]


# Kills the server (rank 0) as it writes last.pt for a round: every silo has saved that round already.
KILL_SERVER = textwrap.dedent(
    """
    import os

    if os.environ.get("OMPI_COMM_WORLD_RANK") == "0" and os.environ.get("SSFL_TEST_KILL_SERVER_AT"):
        import fedml_ssfl.runtime.common as _common

        _at, _real = int(os.environ["SSFL_TEST_KILL_SERVER_AT"]), _common.save_checkpoint

        def _save(path, payload):
            if os.path.basename(str(path)) == "last.pt" and payload.get("round") == _at:
                os._exit(9)
            return _real(path, payload)

        _common.save_checkpoint = _save
    """
)


def test_a_server_killed_in_a_checkpoint_round_resumes_to_the_simulators_model(deployment, tmp_path):
    """Two-phase checkpoints across processes: the silos saved round 2, the server died before its last.pt of
    round 2; every silo kept round 1's state, so the resume (every process new) ends with the simulator's model."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(KILL_SERVER)
    env = mpi_env(SSFL_TEST_KILL_SERVER_AT="1")
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    name = ["--set", "common_args.run_name=killed"]
    killed = mpirun(4, [str(CLI), "run", "--cf", str(deployment["config"]), *name], env=env)
    assert killed.returncode != 0
    run_dir = _run_dir(deployment, "killed")
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["round"] == 0  # round 2 was never committed
    for silo in range(3):
        names = sorted(p.name for p in (run_dir / f"silo_{silo}" / "checkpoints").glob("silo_state-*.pt"))
        assert names == ["silo_state-1.pt", "silo_state-2.pt"], names  # round 2 saved, round 1 kept
    resumed = mpirun(4, [str(CLI), "run", "--cf", str(deployment["config"]), *name, "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_checkpoint(deployment["local"].run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    for k, v in a["algorithm"]["global_state"].items():
        assert float((v - b["algorithm"]["global_state"][k]).abs().max()) < 1e-5, k
    assert [r["round"] for r in metrics(run_dir)] == [1, 2, 3]
    assert [r["test_acc"] for r in metrics(run_dir)] == [r["test_acc"] for r in metrics(deployment["local"].run_dir)]


def test_a_second_server_for_a_run_folder_in_use_is_refused_naming_the_holder(deployment):
    from fedml_ssfl.runtime.folder_lock import lock_folder

    run_dir = _run_dir(deployment)  # the full run's folder, held here as a running server would hold it
    before = (run_dir / "metrics.jsonl").read_text()
    with lock_folder(run_dir):
        proc = mpirun(4, [str(CLI), "run", "--cf", str(deployment["config"]), "--resume", str(run_dir)])
    assert proc.returncode != 0
    line = f"fedml-ssfl: error: rank 0: the run folder {run_dir} is in use by another process (pid {os.getpid()}"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing of the held run was touched


def test_a_silo_whose_data_disagrees_is_refused_by_name(deployment, tmp_path):
    import numpy as np

    from fedml_ssfl.data.local_files import read_npz, write_npz

    good = read_npz(deployment["data"] / "silo_1.npz")
    bad = tmp_path / "silo_1.npz"
    write_npz(bad, torch.zeros((4, 3, 8, 8), dtype=torch.uint8), np.full(4, -1))  # RGB, the server's data is grey
    for k in (0, 2):
        (tmp_path / f"silo_{k}.npz").symlink_to(deployment["data"] / f"silo_{k}.npz")
    assert good.images.shape[1] == 1
    proc = mpirun(
        4,
        [
            str(CLI),
            "run",
            "--cf",
            str(deployment["config"]),
            "--set",
            f"data_args.local_data={tmp_path}/silo_{{silo}}.npz",
            "--set",
            "common_args.run_name=refused",
        ],
    )
    assert proc.returncode != 0
    summary = json.loads((_run_dir(deployment, "refused") / "summary.json").read_text())
    assert summary["status"] == "failed" and "silo 1" in summary["error"] and "3x8x8" in summary["error"], summary


def test_deployment_needs_its_files_named(tmp_path):
    base = [*SETTINGS, "common_args.training_type=cross_silo", "comm_args.backend=MPI", "comm_args.mode=deployment"]
    with pytest.raises(ConfigError, match="data_args.local_data"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="backend MPI or GRPC"):
        load_config(None, [*SETTINGS, "comm_args.mode=deployment"])
    files = ["data_args.local_data=s_{silo}.npz", "data_args.server_data=s.npz", "data_args.test_data=t.npz"]
    named = load_config(None, [s for s in base if not s.startswith("data_args.dataset=")] + files)
    assert named.data_args.dataset == "silo_files" and named.common_args.run_name == "silo_files_fedavg_ssl"
    assert load_config(None, [*base, *files]).data_args.dataset == "digits"  # a dataset the config names stays
    with pytest.raises(ConfigError, match="set all three to FedMLRunner, or all to files"):
        load_config(None, [*base, *files, "data_args.test_data=FedMLRunner"])


@pytest.mark.parametrize("stock", [False, True], ids=["package_runtime", "fedml_stock_transport"])
def test_fedml_runner_script_ends_with_the_simulators_model(deployment, tmp_path, stock):
    """deploy/fedml_runner.py: FedML's FedMLRunner with the public trainer and aggregator, on the package's
    runtime (run_fedml: progress lines, the run folder named), or on FedML's own managers when asked."""
    import yaml

    raw = yaml.safe_load(Path(deployment["config"]).read_text())
    raw["common_args"]["run_name"] = "stock_runner"
    raw["comm_args"]["fedml_stock_transport"] = stock
    config = tmp_path / "fedml_config.yaml"
    config.write_text(yaml.safe_dump(raw))
    runner = Path(__file__).resolve().parents[1] / "deploy" / "fedml_runner.py"
    proc = mpirun(4, [sys.executable, str(runner), "--cf", str(config)], env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = _run_dir(deployment, "stock_runner")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and not summary["refused_replies"], summary
    a = load_checkpoint(deployment["local"].run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert [r["test_acc"] for r in metrics(run_dir)] == [r["test_acc"] for r in metrics(deployment["local"].run_dir)]
    wire = [(r.get("round"), r["wire_bytes_up"], r["wire_bytes_down"]) for r in metrics(run_dir)]
    assert all(up > 0 and down > 0 for _, up, down in wire), wire  # measured on MPI
    said = proc.stdout + proc.stderr
    assert ("FedML's own managers and transport run this job" in said) == stock
    assert (f"outputs: {run_dir}" in said) == (not stock), said[-3000:]  # the package's closing line


def test_fedml_runner_refuses_a_simulation_config(tmp_path):
    from types import SimpleNamespace

    import yaml

    pytest.importorskip("mpi4py")
    from fedml_ssfl.runtime.fedml import hooks as fedml_hooks

    config = tmp_path / "c.yaml"
    config.write_text(simulation_config(tmp_path).to_yaml())
    with pytest.raises(ConfigError, match="comm_args.mode: deployment"):  # training_type simulation too
        fedml_hooks.init(SimpleNamespace(yaml_config_file=str(config), rank=0, run_id="0"))
    raw = simulation_config(tmp_path).to_dict()
    raw["common_args"]["training_type"], raw["comm_args"]["backend"] = "cross_silo", "MPI"
    config.write_text(yaml.safe_dump(raw))  # FedML's runtime in simulation mode: not FedMLRunner's
    with pytest.raises(ConfigError, match="comm_args.mode: deployment"):
        fedml_hooks.init(SimpleNamespace(yaml_config_file=str(config), rank=0, run_id="0"))
    with pytest.raises(ConfigError, match="hooks.init"):
        fedml_hooks.load_data(SimpleNamespace())


def test_fedml_runner_over_grpc_needs_insecure_said_out_loud(deployment, tmp_path):
    """FedML's stock GRPC transport, asked for, unpickles and has no TLS or key: refused unless
    comm_args.insecure; without comm_args.fedml_stock_transport the package's transport runs (TLS)."""
    from types import SimpleNamespace

    import yaml

    from fedml_ssfl.runtime.fedml import hooks as fedml_hooks

    raw = yaml.safe_load(Path(deployment["config"]).read_text())
    raw["comm_args"]["backend"] = "GRPC"
    config = tmp_path / "grpc.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as ours:  # on to the package's checks: this config names no ipconfig
        fedml_hooks.init(SimpleNamespace(yaml_config_file=str(config), rank=0, role="server", run_id="0"))
    assert "unpickles" not in str(ours.value)
    raw["comm_args"]["fedml_stock_transport"] = True
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="stock GRPC transport unpickles.*comm_args.insecure: true"):
        fedml_hooks.init(SimpleNamespace(yaml_config_file=str(config), rank=0, role="server", run_id="0"))


def test_the_command_partition_export_prints_runs_as_printed_here(tmp_path, capsys):
    """`partition --export` ends with "run it: mpirun ...": it must start on this machine as printed
    (Open MPI refuses more processes than cores without --oversubscribe: "not enough slots")."""
    import os
    import shlex
    import subprocess

    from fedml_ssfl.cli import main

    sets = [f"--set={s}" for s in SETTINGS] + [f"--set=common_args.output_dir={tmp_path / 'runs'}"]
    assert main(["partition", *sets, "--export", str(tmp_path / "data")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("run it: "))
    words = shlex.split(line[len("run it: ") :])
    assert words[:3] == ["mpirun", "-np", "4"] and ("--oversubscribe" in words) == (4 > (os.cpu_count() or 1))
    program = words.index("fedml-ssfl")
    assert words[program:] == ["fedml-ssfl", "run", "--cf", str((tmp_path / "data" / "deployment.yaml").resolve())]
    # mpirun's part as printed, with a program that starts in no time (the deployment tests run fedml-ssfl)
    env = {k: v for k, v in mpi_env().items() if k != "OMPI_MCA_rmaps_base_oversubscribe"}
    proc = subprocess.run([*words[:program], "true"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
