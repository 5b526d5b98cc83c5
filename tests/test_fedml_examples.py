"""FedML's own cross-silo examples, edited as a FedML user does, run on the package's runtime.

``tests/fedml_examples/`` holds FedML's example scripts and YAMLs as FedML wrote them (MPI:
``mpi_fedavg_mnist_lr_example``; GRPC: ``grpc_fedavg_mnist_lr_example/step_by_step``). Each test
copies one and applies the edit docs/deploy_reference.md "Coming from FedML" describes: the trainer
and aggregator become ``SSFLTrainer`` / ``SSFLAggregator``, ``fedml.data.load`` the user's own list
(a tiny one from the shipped digits: FedML's loaders download), ``fedml.model.create`` the user's
own module (with BatchNorm); and the YAML keys that table names. The runs end with exactly the model
the same classes compute in this process (:func:`tests.test_fedml_script._round_trip`), with a
progress line per round and the run folder named on the server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

pytest.importorskip("fedml")
pytest.importorskip("mpi4py")
pytest.importorskip("grpc")

from tests.test_fedml_grpc import env, finish, free_ports, make_certs  # noqa: E402  (after the skips)
from tests.test_fedml_mpi import mpi_env, mpirun  # noqa: E402
from tests.test_fedml_script import _round_trip  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent / "fedml_examples"
MPI_EXAMPLE = EXAMPLES / "mpi_fedavg_mnist_lr_example"
GRPC_EXAMPLE = EXAMPLES / "grpc_fedavg_mnist_lr_example" / "step_by_step"

USER_PARTS = textwrap.dedent(
    '''
    """The user's own model (with BatchNorm) and dataset list, next to their edited FedML script."""
    import torch
    from torch import nn


    class BNNet(nn.Module):
        def __init__(self, classes=10):
            super().__init__()
            torch.manual_seed(0)  # every process starts from the same weights
            self.features = nn.Sequential(
                nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()
            )
            self.out = nn.Linear(24, classes)

        def forward(self, x):
            return self.out(self.features(x))


    def tiny_list(args, silos=2, per_silo=120):
        """FedML's 8 entries: silo k = every silos-th of the first silos * per_silo digits, 200 test images."""
        from fedml_ssfl.data import load_dataset

        d = load_dataset("digits")
        n = silos * per_silo
        x, y = d.train_images[:n].float() / 255, d.train_labels[:n]
        loader = lambda i: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[i], y[i]), batch_size=32)
        parts = {k: torch.arange(k, n, silos) for k in range(silos)}
        test = torch.utils.data.TensorDataset(d.test_images[:200].float() / 255, d.test_labels[:200])
        return [
            n, 200, loader(torch.arange(n)), torch.utils.data.DataLoader(test, batch_size=64),
            {k: len(p) for k, p in parts.items()}, {k: loader(p) for k, p in parts.items()}, None, 10,
        ]
    '''
)

SCRIPT_EDITS = [
    (
        "from fedml import FedMLRunner\n",
        "from fedml import FedMLRunner\n"
        "from fedml_ssfl.runtime.fedml.hooks import SSFLAggregator, SSFLTrainer\n"
        "from user_parts import BNNet, tiny_list\n",
    ),
    ("dataset, output_dim = fedml.data.load(args)", "dataset, output_dim = tiny_list(args), 10"),
    ("model = fedml.model.create(args, output_dim)", "model = BNNet(output_dim)"),
    (
        "FedMLRunner(args, device, dataset, model)",
        "FedMLRunner(args, device, dataset, model, SSFLTrainer(model, args), SSFLAggregator(model, args))",
    ),
]
"""docs/deploy_reference.md "Coming from FedML": the lines of FedML's example a user changes."""


def edited_script(source: Path, folder: Path) -> Path:
    """FedML's example script with the user's edit (each line found exactly once), beside their parts."""
    text = source.read_text()
    for old, new in SCRIPT_EDITS:
        assert text.count(old) == 1, (source, old)
        text = text.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "user_parts.py").write_text(USER_PARTS)
    out = folder / source.name
    out.write_text(text)
    return out


def edited_yaml(source: Path, out: Path, comm: dict, run_name: str, runs: Path) -> Path:
    """FedML's example YAML with the keys the "Coming from FedML" table says to change, for a 2-silo, 2-round job."""
    raw = yaml.safe_load(source.read_text())
    raw["common_args"].update(training_type="cross_silo", run_name=run_name, output_dir=str(runs))
    raw["data_args"].update(dataset="my_digits", num_server_labels=40, num_server_val=10)
    raw["data_args"].pop("data_cache_dir")
    t = raw["train_args"]
    t.pop("epochs")
    t.update(federated_optimizer="FedAvg", client_num_in_total=2, client_num_per_round=2, comm_round=2, local_steps=3)
    t.update(batch_size=16, learning_rate=0.05)
    t.pop("server_optimizer", None)
    raw["validation_args"]["frequency_of_the_test"] = 1
    raw["device_args"].update(worker_num=2, num_threads=1)
    for key in ("gpu_mapping_file", "gpu_mapping_key"):
        raw["device_args"].pop(key)
    raw["comm_args"].update(comm)
    raw["ssfl_args"] = {"algorithm": "fedavg_ssl", "threshold": 0.0, "bootstrap_steps": 10}
    out.write_text(yaml.safe_dump(raw))
    return out


def in_process_model(folder: Path, config: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The global model the same classes compute in this process, on the same list and module."""
    sys.path.insert(0, str(folder))
    try:
        import user_parts

        module = SimpleNamespace(digits_list=lambda silos: user_parts.tiny_list(None, silos), TinyNet=user_parts.BNNet)
        run = _round_trip(SimpleNamespace(config=config, module=module), tmp)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("user_parts", None)
    assert run.aggregator.result.summary["status"] == "completed"
    return run.aggregator.runtime.exp.algorithm.global_model().state_dict()


def saved_model(run_dir: Path) -> dict[str, torch.Tensor]:
    from fedml_ssfl.checkpoint import load_checkpoint

    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]


def assert_same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert any("running_mean" in k for k in a)  # BatchNorm's statistics travel with the model
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_server_said(stderr: str, backend: str, run_dir: Path) -> None:
    rounds = [line for line in stderr.splitlines() if f"fedavg_ssl [FedML {backend}]: round" in line]
    assert len(rounds) == 2 and all("test acc" in line for line in rounds), stderr[-3000:]
    end = [line for line in stderr.splitlines() if f"fedavg_ssl [FedML {backend}]: completed after round 2" in line]
    assert len(end) == 1 and end[0].endswith(f"outputs: {run_dir}"), stderr[-3000:]


def test_fedmls_mpi_example_edited_as_the_docs_say_runs_on_the_packages_runtime(tmp_path):
    script = edited_script(MPI_EXAMPLE / "cross_silo_with_mpi.py", tmp_path / "job")
    config = edited_yaml(
        MPI_EXAMPLE / "config" / "fedml_config.yaml", tmp_path / "job" / "c.yaml", {}, "mpi_example", tmp_path / "runs"
    )
    proc = mpirun(3, [sys.executable, str(script), "--cf", str(config)], env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mpi_example"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model"] == "BNNet-bn"
    assert summary["runtime"] == "fedml-MPI"  # the runtime of fedml-ssfl run, not FedML's stock managers
    assert_server_said(proc.stderr + proc.stdout, "MPI", run_dir)
    assert_same_model(saved_model(run_dir), in_process_model(tmp_path / "job", config, tmp_path / "reference"))


def grpc_job(tmp: Path, run_name: str) -> tuple[Path, Path, Path]:
    """FedML's GRPC step-by-step example, edited, with mutual TLS and a job key on free local ports."""
    job = tmp / "job"
    server = edited_script(GRPC_EXAMPLE / "torch_server.py", job)
    client = edited_script(GRPC_EXAMPLE / "torch_client.py", job)
    ip = job / "grpc_ipconfig.csv"
    ip.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" + "".join(
        f"{r},{r},127.0.0.1,{p}\n" for r, p in enumerate(free_ports(3))
    ))  # fmt: skip
    security = dict(item.split("=", 1) for item in make_certs(tmp, 3))
    comm = {"grpc_ipconfig_path": str(ip), **{k.split(".", 1)[1]: v for k, v in security.items()}}
    config = edited_yaml(GRPC_EXAMPLE / "config" / "fedml_config.yaml", job / "c.yaml", comm, run_name, tmp / "runs")
    return server, client, config


def start_grpc(server: Path, client: Path, config: Path, *extra: str) -> list[subprocess.Popen]:
    procs = []
    for rank in range(3):
        script, role = (server, "server") if rank == 0 else (client, "client")
        cmd = [sys.executable, str(script), "--cf", str(config), "--rank", str(rank), "--role", role, *extra]
        procs.append(
            subprocess.Popen(
                cmd, cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
            )
        )
    return procs


def test_fedmls_grpc_example_edited_as_the_docs_say_runs_with_mutual_tls_and_resumes(tmp_path):
    server, client, config = grpc_job(tmp_path, "grpc_example")
    run_dir = tmp_path / "runs" / "grpc_example"
    results = finish(start_grpc(server, client, config, "--stop-after", "1"), 240)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 1 and summary["runtime"] == "fedml-GRPC"
    results = finish(start_grpc(server, client, config, "--resume", str(run_dir)), 240)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["model"] == "BNNet-bn"
    stderr = results[0][2]
    assert "round 2/2: test acc" in stderr and "completed after round 2 of 2" in stderr, stderr[-3000:]
    assert stderr.rstrip().endswith(f"outputs: {run_dir}") or f"outputs: {run_dir}" in stderr
    assert "plaintext" not in stderr and "unpickles" not in stderr  # TLS and the job key: no stock transport
    assert_same_model(saved_model(run_dir), in_process_model(tmp_path / "job", config, tmp_path / "reference"))


def test_every_transport_implements_what_the_managers_use():
    """The seam: the managers reach their transport only through ``Transport``'s names, and the MPI and
    GRPC classes have every one of them (a transport added later implements the same list)."""
    import ast
    import inspect

    from fedml_ssfl.runtime.fedml import connect_out, managers, transports
    from fedml_ssfl.runtime.fedml.transport import Transport

    names = {n for n in dir(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    for cls in (transports.QuietMpiComm, transports.QuietGrpcComm, connect_out.ConnectOutComm):
        missing = sorted(n for n in names if not hasattr(cls, n) and n not in ("heard",))
        assert not missing, (cls.__name__, missing)
    assert hasattr(transports.QuietMpiComm, "heard")  # a property there, an attribute on GRPC's
    used = set()
    for node in ast.walk(ast.parse(inspect.getsource(managers))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if node.value.attr in ("transport", "com_manager") or (
                isinstance(node.value.value, ast.Name) and node.value.attr == "comm"
            ):
                used.add(node.attr)
    used -= {"transport"}
    assert used and used <= names, sorted(used - names)
    assert set(transports.TRANSPORTS) == {"MPI", "GRPC", "GRPC_CONNECT_OUT"}


LAB_SUBNET = "10.203.0"  # addresses only inside the namespaces the lab makes
LAB_PORT = 8890


def test_fedmls_grpc_example_rides_out_a_silo_killed_and_restarted_in_the_network_lab(make_lab, tmp_path):
    """FedML's GRPC step-by-step example, edited as the docs say, across hosts in network namespaces
    (tests/netlab.py: the server and two silos at 10.203.0.1-3, mutual TLS with certificates naming those
    addresses, a job key): once round 1 is committed silo 1 is killed (SIGKILL) and started again 1 s later
    with the same command; the run ends with exactly the model the same classes compute in one process."""
    from tests.lab_job import ROOT as REPO
    from tests.test_network_faults import BUDGETS, HOSTS, Job

    job = tmp_path / "job"
    server = edited_script(GRPC_EXAMPLE / "torch_server.py", job)
    client = edited_script(GRPC_EXAMPLE / "torch_client.py", job)
    certs = tmp_path / "certs"
    sans = [f"IP:{LAB_SUBNET}.{r + 1}" for r in range(3)]
    subprocess.run(["bash", str(REPO / "deploy/make_test_certs.sh"), str(certs), "3", *sans], check=True)
    ip = job / "grpc_ipconfig.csv"
    ip.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" + "".join(
        f"{r},{r},{LAB_SUBNET}.{r + 1},{LAB_PORT}\n" for r in range(3)
    ))  # fmt: skip
    comm = {
        "grpc_ipconfig_path": str(ip),
        "tls_ca": str(certs / "ca.pem"),
        "tls_cert": str(certs / "rank{rank}.pem"),
        "tls_key": str(certs / "rank{rank}.key"),
        "job_key_file": str(certs / "job.key"),
    }
    config = edited_yaml(GRPC_EXAMPLE / "config" / "fedml_config.yaml", job / "c.yaml", comm, "lab", tmp_path / "runs")
    raw = yaml.safe_load(config.read_text())
    raw.setdefault("tracking_args", {})["checkpoint_every"] = 1  # a silo restarted alone reloads its last round
    raw["train_args"]["comm_round"] = 3  # rounds 2 and 3 after the restart: it cannot end before the kill
    config.write_text(yaml.safe_dump(raw))

    class ScriptJob(Job):
        """The lab job of tests/test_network_faults.py, each rank running the user's edited FedML script."""

        def start(self, rank: int, resume: bool = False):
            script, role = (server, "server") if rank == 0 else (client, "client")
            argv = [sys.executable, str(script), "--cf", str(config), "--rank", str(rank), "--role", role, *self.sets]
            old = self.procs.get(rank)
            self.procs[rank] = (
                self.lab.spawn(HOSTS[rank], argv, env=self.env, name=f"rank{rank}")
                if old is None
                else self.lab.restart(old, argv)
            )
            return self.procs[rank]

    lab = make_lab(HOSTS, subnet=LAB_SUBNET)
    run = ScriptJob(lab, {"config": config, "local": None}, tmp_path, "lab")
    assert not set(BUDGETS) & set(run.env)  # the default waiting budgets a user gets
    run.start_all()
    run.wait_until("the server's checkpoint of round 1", lambda: run.committed() >= 1, timeout=150)
    run.kill(2)
    time.sleep(1.0)
    run.start(2)  # the same command again: it rejoins and reloads its state of round 1
    run.finish(bound=240)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3, summary
    assert_same_model(saved_model(run.run_dir), in_process_model(job, config, tmp_path / "reference"))
    assert not run.record.exists(), run.record.read_text()  # no process tried an address the lab lacks
