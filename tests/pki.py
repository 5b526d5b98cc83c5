"""A test certificate authority that keeps its key, to sign certificates the tests need: expired ones,
ones for the wrong name, ones of another CA (deploy/make_test_certs.sh deletes its CA key)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(folder: Path) -> Path:
    """A CA (``ca.pem``, ``ca.key``) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "30",
        "-subj", f"/CN=test CA {folder.name}", "-keyout", "ca.key", "-out", "ca.pem", cwd=folder,
    )  # fmt: skip
    return folder


def make_cert(ca: Path, name: str, san: str = "IP:127.0.0.1", days: int = 30) -> tuple[Path, Path]:
    """A certificate and key ``name.pem`` / ``name.key`` signed by ``ca`` for ``san``; ``days=-1`` has expired."""
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=ca,
    )  # fmt: skip
    (ca / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", str(days), "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=ca,
    )  # fmt: skip
    return ca / f"{name}.pem", ca / f"{name}.key"
