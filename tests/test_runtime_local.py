"""The local runtime: outputs, sampling, exact resume, refusing bad checkpoints, NaN handling."""

from __future__ import annotations

import json

import pytest
import torch

from fedml_ssfl import seeding
from fedml_ssfl.algorithms.base import check_finite
from fedml_ssfl.algorithms.fedavg_ssl import FedAvgSSL
from fedml_ssfl.checkpoint import CheckpointError, load_checkpoint
from fedml_ssfl.config import ConfigError
from fedml_ssfl.runtime.local import RunFailed, run_local
from fedml_ssfl.sampling import sample_clients
from tests.conftest import resume_matches_uninterrupted


def global_state(run_dir):
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]


def test_sampler_is_seeded_and_picks_ck_of_k():
    a = [sample_clients(3, r, 10, 4) for r in range(5)]
    b = [sample_clients(3, r, 10, 4) for r in range(5)]
    assert a == b
    assert all(len(c) == 4 and len(set(c)) == 4 and max(c) < 10 for c in a)
    assert len({tuple(c) for c in a}) > 1  # rounds differ
    assert sample_clients(3, 0, 10, 4) != sample_clients(4, 0, 10, 4) or sample_clients(3, 1, 10, 4) != sample_clients(
        4, 1, 10, 4
    )
    assert sample_clients(0, 0, 5, 5) == [0, 1, 2, 3, 4]


def test_run_writes_every_output(small_config, tmp_path):
    cfg = small_config(
        "tracking_args.enable_tensorboard=true", "validation_args.frequency_of_the_test=2", "train_args.comm_round=3"
    )
    res = run_local(cfg, run_dir=tmp_path / "run")
    d = res.run_dir
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]  # 1-based, as in the plots and TensorBoard
    assert "test_acc" not in rows[0] and "test_acc" in rows[1] and "test_acc" in rows[2]  # every 2 + last
    assert all(r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in rows)
    # bytes are the real tensor bytes: 4 clients x full float32 model each way
    model_bytes = sum(t.numel() * t.element_size() for t in global_state(d)["global_state"].values())
    assert rows[0]["bytes_up"] == 4 * model_bytes
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert summary["final_test_acc"] == pytest.approx(rows[-1]["test_acc"])
    assert (d / "config.yaml").is_file()
    assert (d / "plots" / "accuracy.png").stat().st_size > 1000
    assert (d / "plots" / "bytes.png").stat().st_size > 1000
    assert any((d / "tb").iterdir())
    assert "weight_diversity" in rows[0] and "client_mask_rate" in rows[0]


def test_a_new_run_never_overwrites_an_old_one(small_config, tmp_path):
    cfg = small_config("train_args.comm_round=1")
    first = run_local(cfg, run_dir=tmp_path / "run")
    second = run_local(cfg, run_dir=tmp_path / "run")
    assert first.run_dir != second.run_dir and first.run_dir.exists()


@pytest.mark.parametrize("averaging", ["fedavg", "grouping"])
def test_resume_ends_with_the_uninterrupted_model(small_config, tmp_path, averaging):
    cfg = small_config(
        "train_args.comm_round=4", "train_args.client_num_per_round=3", f"ssfl_args.averaging={averaging}"
    )
    full = run_local(cfg, run_dir=tmp_path / "full")
    part = run_local(cfg, run_dir=tmp_path / "part", stop_after=2)
    assert part.summary["status"] == "stopped" and part.rounds_completed == 2
    resumed = run_local(cfg, run_dir=tmp_path / "part", resume=True)
    assert resumed.rounds_completed == 4
    a, b = global_state(full.run_dir), global_state(resumed.run_dir)
    for k in a["global_state"]:
        assert torch.equal(a["global_state"][k], b["global_state"][k]), k
    assert resumed.final_acc == full.final_acc
    rows = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]


def test_global_stream_is_seeded_per_party_and_restores_the_outer_stream():
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    with seeding.global_stream(0, "client", 2, 5):
        a = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)  # the outer stream is as it was
    with seeding.global_stream(0, "client", 2, 5):
        assert torch.equal(torch.rand(3), a)
    with seeding.global_stream(0, "client", 2, 6):
        assert not torch.equal(torch.rand(3), a)


def test_resume_is_exact_for_a_dropout_model(small_config, tmp_path):
    # fedsiam_cifar_cnn has dropout, which draws from torch's global stream: the runtime seeds it
    # per (round, party), so a resumed run sees the same dropout masks as an uninterrupted one
    cfg = small_config("ssfl_args.algorithm=fedavg_sl", "model_args.model=fedsiam_cifar_cnn", "train_args.comm_round=3")
    resume_matches_uninterrupted(cfg, tmp_path, stop_after=1)


def test_corrupt_checkpoint_is_refused_and_left_untouched(small_config, tmp_path):
    cfg = small_config("train_args.comm_round=1")
    res = run_local(cfg, run_dir=tmp_path / "run")
    ckpt = res.run_dir / "checkpoints" / "last.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    damaged = ckpt.read_bytes()
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        run_local(cfg, run_dir=res.run_dir, resume=True)
    assert ckpt.read_bytes() == damaged


def test_checkpoint_of_another_config_is_refused(small_config, tmp_path):
    res = run_local(small_config("train_args.comm_round=1"), run_dir=tmp_path / "run")
    other = small_config("train_args.comm_round=1", "train_args.learning_rate=0.5")
    with pytest.raises(
        CheckpointError, match=r"resume refused: .*train_args\.learning_rate \(checkpoint 0\.03, now 0\.5\)"
    ):
        run_local(other, run_dir=res.run_dir, resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        run_local(other, run_dir=tmp_path / "empty", resume=True)


def test_nan_loss_stops_naming_round_and_client_and_keeps_last_checkpoint(small_config, tmp_path, monkeypatch):
    original = FedAvgSSL.client_update

    def poisoned(self, msg, data, state, ctx):
        if ctx.round_idx == 2 and data.client_id == 1:
            check_finite(torch.tensor(float("nan")), ctx.round_idx, f"client {data.client_id}")
        return original(self, msg, data, state, ctx)

    monkeypatch.setattr(FedAvgSSL, "client_update", poisoned)
    cfg = small_config("train_args.comm_round=4")
    with pytest.raises(RunFailed, match="round 3 on client 1.*last.pt"):
        run_local(cfg, run_dir=tmp_path / "run")
    kept = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert kept["round"] == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_impossible_data_settings_fail_before_training(small_config, tmp_path):
    with pytest.raises(ConfigError, match="num_server_labels"):
        run_local(small_config("data_args.num_server_labels=5000"), run_dir=tmp_path / "r1")
    with pytest.raises(ConfigError, match="cuda"):
        if torch.cuda.is_available():
            raise ConfigError("cuda present: nothing to check")
        run_local(small_config("device_args.device=cuda"), run_dir=tmp_path / "r2")


def test_damaged_tensor_bytes_are_refused_naming_the_file(small_config, tmp_path):
    """torch's zip reader never checks the archive's CRCs; the checkpoint's own digest does."""
    from fedml_ssfl.checkpoint import save_checkpoint

    path = tmp_path / "last.pt"
    pattern = torch.arange(4000, dtype=torch.float32)
    sparse = torch.tensor([[0.0, 1.5], [2.0, 0.0]]).to_sparse()  # FedMatch keeps sparse deltas
    save_checkpoint(path, {"round": 0, "algorithm": {"w": pattern, "bn_count": torch.tensor(3), "d": sparse}})
    assert int(load_checkpoint(path)["algorithm"]["bn_count"]) == 3  # a 0-d tensor (BatchNorm's counter)
    data = bytearray(path.read_bytes())
    at = data.find(pattern[500:].numpy().tobytes()[:64])
    assert at > 0
    data[at : at + 2000] = bytes(2000)  # 2,000 zeroed bytes inside the tensor; the file still unzips
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["algorithm"]["w"][600] == 0  # torch itself loads it
    with pytest.raises(CheckpointError, match=f"{path} does not match its content digest"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="carries no content digest"):
        torch.save({"format": 1, "round": 0}, path)
        load_checkpoint(path)


def test_killed_writes_leave_no_temporary_files_behind(tmp_path):
    from fedml_ssfl.checkpoint import save_checkpoint

    path = tmp_path / "last.pt"
    for i in range(3):  # what a kill during torch.save leaves
        (tmp_path / f"last.pt.abc{i}.tmp").write_bytes(b"x" * 100)
    (tmp_path / "other.pt.abc.tmp").write_bytes(b"y")  # another file's: not ours to remove
    save_checkpoint(path, {"round": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "other.pt.abc.tmp"]
    assert load_checkpoint(path)["round"] == 1


def test_run_folders_are_claimed_atomically_by_parallel_processes(tmp_path):
    """Eight processes started at once with one run name get eight folders."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from fedml_ssfl.runtime.common import fresh_run_dir; "
        "print(fresh_run_dir(Path(sys.argv[1])))"
    )
    base = tmp_path / "race"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(base)], stdout=subprocess.PIPE, text=True) for _ in range(8)
    ]
    got = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(got)) == 8 and str(base) in got, got
    (base.parent / "race-old").mkdir()
    (base.parent / "race-old" / "metrics.jsonl").write_text("{}")  # an older run's folder is never claimed
    from fedml_ssfl.runtime.common import fresh_run_dir

    assert fresh_run_dir(base.parent / "race-old") == base.parent / "race-old-2"


def test_a_run_folder_is_locked_while_held_and_released_with_its_holder(tmp_path):
    import socket

    from fedml_ssfl.runtime.common import discard_unwritten, fresh_run_dir, hold_run_folder
    from fedml_ssfl.runtime.folder_lock import FolderInUse

    run_dir = fresh_run_dir(tmp_path / "r")
    lock = hold_run_folder(run_dir)
    with pytest.raises(FolderInUse) as err:  # a second open of the lock file conflicts, even in this process
        hold_run_folder(run_dir, resume=True)
    text = str(err.value)
    assert f"the run folder {run_dir} is in use by another process (pid {__import__('os').getpid()} on host" in text
    assert socket.gethostname() in text and "\n" not in text and "wait for that one to end" in text
    lock.release()
    hold_run_folder(run_dir, resume=True).release()  # free again
    assert hold_run_folder(tmp_path / "missing", resume=True) is None  # loading its checkpoint says what is wrong
    assert discard_unwritten(run_dir) and not run_dir.exists()  # claim and lock files only: nothing was written


def test_two_resumes_of_one_run_folder_at_once_the_second_is_refused(small_config, tmp_path):
    """Real processes: a resume holds the folder; a second ``fedml-ssfl run --resume`` of it is refused at once, in
    one line naming the folder and the holder, and writes nothing; a killed holder's lock goes with it."""
    import os
    import subprocess
    import sys
    import time

    cfg = small_config("train_args.comm_round=1000", "validation_args.frequency_of_the_test=1000")
    run_dir = tmp_path / "r"
    run_local(cfg, run_dir=run_dir, stop_after=1)
    cli = [sys.executable, "-m", "fedml_ssfl", "run", str(run_dir / "config.yaml"), "--resume", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while f'"pid": {first.pid},' not in (run_dir / ".lock").read_text() and first.poll() is None:
            assert time.monotonic() < deadline, "the first resume never took the folder"
            time.sleep(0.2)
        assert first.poll() is None, first.stderr.read()
        second = subprocess.run([*cli, "--stop-after", "3"], capture_output=True, text=True, timeout=180, env=env)
        assert first.poll() is None  # still running: the refusal was not a race with its end
    finally:
        first.kill()
        first.wait(timeout=60)
    assert second.returncode == 2, second.stderr
    line = f"fedml-ssfl: error: the run folder {run_dir} is in use by another process (pid {first.pid} on host"
    assert second.stderr.startswith(line) and second.stderr.count("\n") == 1, second.stderr
    rounds = [r["round"] for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert rounds == sorted(set(rounds)), rounds  # no round written twice
    resumed = run_local(cfg, run_dir=run_dir, resume=True, stop_after=1)  # the OS let the killed holder's lock go
    assert resumed.rounds_completed >= 1


def test_run_name_stays_inside_output_dir(small_config):
    for bad in ("../../x", "a/b", "..", ""):
        with pytest.raises(ConfigError, match="common_args.run_name: .* one folder name inside common_args.output_dir"):
            small_config(f"common_args.run_name={bad}")
