"""`import fedml_ssfl` (and the local runtime, CLI) must work without importing fedml or mpi4py."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import fedml_ssfl, fedml_ssfl.cli, fedml_ssfl.runtime.local, fedml_ssfl.algorithms
fedml_ssfl.algorithms.available_algorithms()
bad = [m for m in ("fedml", "mpi4py") if m in sys.modules]
print(bad)
sys.exit(1 if bad else 0)
"""


def test_package_import_is_free_of_fedml_and_mpi4py():
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
