"""benchmarks/device_load.py at a small scale: one process of virtual devices, each with its own
certificate, connecting out over mutual TLS with the job key to the real server, some dropping their
connection each round; the run completes and the figures are written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("fedml")
pytest.importorskip("grpc")

ROOT = Path(__file__).resolve().parents[1]


def test_the_load_generator_drives_a_connect_out_server_with_devices_that_drop(tmp_path):
    spec = importlib.util.spec_from_file_location("device_load", ROOT / "benchmarks" / "device_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "device_load.json"
    assert bench.main(["--devices", "20", "--rounds", "2", "--away", "1", "--timeout", "240", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["20"]
    assert r["completed"] and r["rounds_done"] == 2, r["server_tail"]
    assert 2 * 2 <= r["devices_dropped"] <= 2 * 6  # 10-30% of 20 devices in each of 2 rounds
    assert r["round_s_p50"] >= 1.0  # a round waits for its droppers (1 s away)
    assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["server_rss_mib_connected"] > 0
