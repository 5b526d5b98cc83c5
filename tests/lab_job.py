"""A GRPC job for the network lab (tests/netlab.py): certificates for the lab's addresses, the ipconfig
and the config every process reads, over an exported deployment (used by tests/test_network_faults.py and
benchmarks/grpc_round_trips.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fedml_ssfl.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def lab_job_config(tmp: Path, exported: Path, hosts: int, subnet: str, port: int) -> Path:
    """Write ``tmp/job.yaml``: rank r at ``{subnet}.{r + 1}:{port}``, mutual TLS (certificates whose
    subjectAltName is that address, made by deploy/make_test_certs.sh) and a job key; returns its path."""
    certs = tmp / "certs"
    sans = [f"IP:{subnet}.{i + 1}" for i in range(hosts)]
    subprocess.run(
        ["bash", str(ROOT / "deploy/make_test_certs.sh"), str(certs), str(hosts), *sans],
        check=True,
        capture_output=True,
    )
    ipconfig = tmp / "ipconfig.csv"
    rows = [f"{r},{r},{subnet}.{r + 1},{port}" for r in range(hosts)]
    ipconfig.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" + "\n".join(rows) + "\n")
    cfg = load_config(
        exported,
        [
            f"comm_args.grpc_ipconfig_path={ipconfig}",
            f"comm_args.tls_ca={certs / 'ca.pem'}",
            f"comm_args.tls_cert={certs / 'rank{rank}.pem'}",
            f"comm_args.tls_key={certs / 'rank{rank}.key'}",
            f"comm_args.job_key_file={certs / 'job.key'}",
        ],
    )
    path = tmp / "job.yaml"
    path.write_text(cfg.to_yaml())
    return path
