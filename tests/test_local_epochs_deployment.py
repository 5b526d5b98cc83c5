"""``train_args.epochs`` in deployment mode: each silo, knowing only its own data, takes its own
T_k = E x ceil(n_k / B) steps and the run ends with the simulator's model (tests/test_local_epochs.py
counts the steps; tests/test_fedml_deployment.py is the same comparison with fixed steps).

Tiny: 3 silos of unequal size (Dirichlet), 2 rounds, one MPI job of 4 processes.
"""

from __future__ import annotations

import pytest

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import load_config
from fedml_ssfl.experiment import build_experiment, export_deployment
from fedml_ssfl.runtime.local import run_local
from tests.conftest import SMALL
from tests.test_fedml_mpi import CLI, metrics, mpi_env, mpirun

pytest.importorskip("fedml")

SETTINGS = [
    *SMALL,
    "train_args.client_num_in_total=3",
    "train_args.client_num_per_round=3",
    "train_args.comm_round=2",
    "train_args.epochs=1",
    "train_args.batch_size=64",
    "data_args.partition_method=dirichlet",
    "data_args.partition_alpha=0.3",
    "ssfl_args.algorithm=fedavg_ssl",
    "ssfl_args.threshold=0.5",
    "ssfl_args.bootstrap_steps=20",  # pseudo-labels flow from round 0
    "device_args.num_threads=1",
]


def test_a_deployment_with_local_epochs_ends_with_the_simulators_model(tmp_path):
    sim = load_config(None, [*SETTINGS, f"common_args.output_dir={tmp_path / 'runs'}", "common_args.run_name=sim"])
    exp = build_experiment(sim)
    own = [exp.algorithm.client_train(exp.client_data(k, 0)).local_steps for k in range(3)]
    assert len(set(own)) > 1, own  # the silos differ in size: each takes its own T_k
    config = export_deployment(sim, tmp_path / "data")
    dep = load_config(config)
    assert dep.comm_args.mode == "deployment" and dep.train_args.epochs == 1  # kept, not turned into steps
    proc = mpirun(4, [str(CLI), "run", "--cf", str(config)], env=mpi_env(), timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    local = run_local(sim, run_dir=tmp_path / "local")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(dep.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    for k, v in a.items():
        assert float((v - b[k]).abs().max()) < 1e-5, k
    assert [r["test_acc"] for r in metrics(local.run_dir)] == [r["test_acc"] for r in metrics(dep.run_dir())]
