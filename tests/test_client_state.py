"""Client state in bounded memory (issue 15, "Scale"): the store, its files, checkpoints and runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedml_ssfl.checkpoint import CheckpointError, load_checkpoint
from fedml_ssfl.client_state import (
    FILES_KEY,
    RECORD_FILES_KEY,
    STATES_DIR,
    ClientStateError,
    ClientStateStore,
    client_state_payload,
    open_client_states,
    prune_state_files,
    read_state_file,
    state_size,
)
from fedml_ssfl.runtime.local import run_local
from tests.conftest import assert_same_state

pytestmark = pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")


def _state(seed: int, n: int = 16) -> dict:
    """A state of every kind a client keeps: tensors of many dtypes, views, nesting, scalars."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, n, generator=g)
    return {
        "target": {"w": base, "b": torch.randn(n, generator=g).half()},
        "view": base.t(),  # a non-contiguous view of a tensor in the same state
        "slice": base[2:5, 1:],
        "ints": torch.randint(-(2**40), 2**40, (n,), generator=g),
        "mask": torch.rand(n, generator=g) > 0.5,
        "bf16": torch.randn(3, generator=g).bfloat16(),
        "sparse": torch.sparse_coo_tensor(
            torch.tensor([[0, 2]]), torch.tensor([1.5, -2.0]), (4,), check_invariants=True
        ),
        "ensemble_count": seed,
        "lr": 0.1 * seed,
        "nan": float("nan"),
        "history": [1, 2.5, "x", None, (True, 3)],
        "empty": torch.empty(0, 3),
    }


def _spill_file(store: ClientStateStore, key: int):
    return store.file_of(key)


# ---- the store -----------------------------------------------------------------------------------
def test_a_spilled_state_comes_back_bit_for_bit(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill")
    states = {k: _state(k) for k in range(3)}
    for k, s in states.items():
        store[k] = s
    assert store.spilled() == [0, 1] and store.is_resident(2)
    for k in range(3):
        back = store[k]
        assert_same_state(states[k], back)
        for name in ("view", "slice", "ints", "mask", "bf16", "empty"):
            assert back[name].dtype == states[k][name].dtype and back[name].stride() == states[k][name].stride()
        assert back["view"].data_ptr() == back["target"]["w"].data_ptr()  # still one storage
        assert type(back["history"][4]) is tuple and math.isnan(back["nan"])
    assert store.loads == 3 and len(store) == 3 and sorted(store) == [0, 1, 2]


def test_least_recently_used_states_spill_first(tmp_path) -> None:
    one = state_size(_state(0))
    store = ClientStateStore(2 * one, tmp_path / "spill")
    for k in range(3):
        store[k] = _state(k)
    assert store.spilled() == [0]  # three do not fit; the oldest went
    store[1]  # 1 is now more recent than 2
    store[3] = _state(3)
    assert store.spilled() == [0, 2]
    store[0]  # back in: the least recently used of the rest (1) goes
    assert store.spilled() == [1, 2] and store.is_resident(0) and store.is_resident(3)


def test_resident_bytes_stay_within_the_budget(tmp_path) -> None:
    one = state_size(_state(0))
    budget = 3 * one + one // 2
    store = ClientStateStore(budget, tmp_path / "spill", fresh=range(20))
    g = torch.Generator().manual_seed(0)
    for step in range(200):
        k = int(torch.randint(20, (1,), generator=g))
        state = store[k]  # the state grown before (in place) is measured now
        resident = [j for j in range(20) if store.is_resident(j)]
        assert store.resident_bytes == sum(state_size(store._resident[j]) for j in resident), step
        assert store.resident_bytes - state_size(state) <= budget  # only the state in use may exceed it
        if not state:
            state.update(_state(k))  # grown in place, as client_update does
    assert store.peak_resident_bytes <= budget + one
    assert store.spills > 0 and len(store.spilled()) >= 16


def test_a_change_made_in_place_survives_a_spill(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill", fresh=[0, 1])
    s = store[0]
    s["ensemble"] = torch.arange(5.0)
    s["ensemble_count"] = 1
    store[1]  # 0 is spilled now, with what was added
    assert store.spilled() == [0]
    assert_same_state(store[0], {"ensemble": torch.arange(5.0), "ensemble_count": 1})


def test_reading_the_state_in_use_again_does_not_spill_it(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill", fresh=[0, 1])
    store[0]["w"] = torch.ones(8)
    assert store[0]["w"].sum() == 8 and store.spills == 0 and store.loads == 0  # the runtime reads twice
    store[1]
    assert store.spilled() == [0]


def test_a_spill_that_cannot_be_written_keeps_the_state_and_says_where(tmp_path) -> None:
    import shutil

    store = ClientStateStore(0, tmp_path / "spill")
    store[0] = _state(0)
    shutil.rmtree(tmp_path / "spill")  # the spill folder is gone (a full or lost disk)
    with pytest.raises(ClientStateError) as err:
        store[1] = _state(1)  # 0 must make room first
    assert str(tmp_path / "spill") in str(err.value) and "\n" not in str(err.value)
    assert "device_args.state_spill_dir" in str(err.value)
    assert store.is_resident(0) and not store.spilled() and 1 not in store
    assert_same_state(store[0], _state(0))  # the one asked for is not spilled to make room for itself
    (tmp_path / "spill").mkdir()  # fixed
    store[1] = _state(1)
    assert store.spilled() == [0] and store.loads == 0
    assert_same_state(store[0], _state(0))


def test_identical_states_share_a_file_and_files_go_with_their_last_user(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill")
    for k in range(3):
        store[k] = {"w": torch.ones(4)}
    store[3] = {}
    files = {_spill_file(store, k) for k in range(3)}
    assert len(files) == 1 and len(list((tmp_path / "spill").glob("*.pt"))) == 1
    store[0]
    store[1]
    assert (tmp_path / "spill" / next(iter(files)).name).exists()  # 2 still uses it (0 and 1 re-spilled share it)
    del store[2]
    store[0]["w"] += 1  # changed: 0 re-spills to a new file; the old one is used by 1 only
    store[3]
    assert len(list((tmp_path / "spill").glob("*.pt"))) == 2
    store.close()
    assert not (tmp_path / "spill").exists()


def test_a_damaged_spill_file_is_refused_in_one_line_naming_it(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill")
    store[0] = _state(0)
    store[1] = _state(1)
    path = _spill_file(store, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ClientStateError) as err:
        store[0]
    text = str(err.value)
    assert str(path) in text and "\n" not in text and "damaged" in text
    path.unlink()
    with pytest.raises(ClientStateError, match="cannot be read"):
        store[0]


def test_a_state_file_is_not_unpickled_beyond_tensors(tmp_path) -> None:
    import hashlib
    import io

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    path = tmp_path / (hashlib.sha256(buf.getvalue()).hexdigest() + ".pt")
    path.write_bytes(buf.getvalue())
    with pytest.raises(ClientStateError, match="is not a client state"):
        read_state_file(path)


def test_checkpoint_entries_link_spilled_files_and_reopen_exactly(tmp_path) -> None:
    store = ClientStateStore(state_size(_state(0)), tmp_path / "spill", fresh=[9])  # one fits
    states = {k: _state(k) for k in range(4)}
    for k, s in states.items():
        store[k] = s
    states_dir = tmp_path / "ckpt" / STATES_DIR
    (states_dir).mkdir(parents=True)
    (states_dir / ("0" * 64 + ".pt")).write_bytes(b"an older checkpoint's file")
    payload = client_state_payload(store, states_dir)
    assert sorted(payload[FILES_KEY]) == [0, 1, 2] and sorted(payload["client_states"]) == [3, 9]
    prune_state_files(states_dir, payload)
    assert sorted(p.stem for p in states_dir.iterdir()) == sorted(payload[FILES_KEY].values())
    store.close()  # the spill folder goes; the checkpoint's links stay
    everything = open_client_states(range(10), None, None, payload, states_dir)
    assert type(everything) is dict
    assert_same_state(everything, {**states, 9: {}})
    again = open_client_states(range(10), 0, tmp_path / "spill2", payload, states_dir)
    assert isinstance(again, ClientStateStore) and sorted(again) == [0, 1, 2, 3, 9]
    assert_same_state({k: again[k] for k in again}, {**states, 9: {}})
    assert sorted(p.stem for p in states_dir.iterdir()) == sorted(payload[FILES_KEY].values())  # never removed


def test_without_hard_links_the_checkpoint_copies_the_spill_files(tmp_path, monkeypatch) -> None:
    """A spill folder on another file system than the checkpoint: each file is copied (atomically)."""
    import fedml_ssfl.client_state as client_state

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(client_state.os, "link", no_links)
    store = ClientStateStore(0, tmp_path / "spill")
    states = {k: _state(k) for k in range(3)}
    for k, v in states.items():
        store[k] = v
    states_dir = tmp_path / "ckpt" / STATES_DIR
    payload = client_state_payload(store, states_dir)
    copies = sorted(states_dir.iterdir())
    assert [p.stem for p in copies] == sorted(payload[FILES_KEY].values()) and len(copies) == 3
    assert all(p.stat().st_nlink == 1 for p in copies)  # copies, not links
    store.close()
    assert_same_state(open_client_states(range(3), None, None, payload, states_dir), states)


def test_a_checkpoint_naming_a_damaged_or_missing_file_is_refused_before_the_run(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill")
    store[0], store[1] = _state(0), _state(1)
    states_dir = tmp_path / STATES_DIR
    payload = client_state_payload(store, states_dir)
    path = states_dir / (payload[FILES_KEY][0] + ".pt")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ClientStateError, match=f"client state file {path} does not match"):
        open_client_states(range(2), 10**9, tmp_path / "s", payload, states_dir)
    path.unlink()
    with pytest.raises(ClientStateError, match="cannot be read"):
        open_client_states(range(2), None, None, payload, states_dir)


def _damage_in_place(path) -> None:
    """Flip one byte in the middle of ``path`` without replacing the file (same inode, as a disk error would)."""
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("links", [True, False], ids=["linked", "copied"])
def test_a_spill_file_damaged_before_a_checkpoint_never_reaches_it(tmp_path, monkeypatch, links) -> None:
    import fedml_ssfl.client_state as client_state

    if not links:
        monkeypatch.setattr(client_state.os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    store = ClientStateStore(0, tmp_path / "spill")
    for k in range(3):
        store[k] = _state(k)
    damaged = _spill_file(store, 1)
    _damage_in_place(damaged)
    states_dir = tmp_path / "ckpt" / STATES_DIR
    with pytest.raises(ClientStateError) as err:
        client_state_payload(store, states_dir)
    text = str(err.value)
    assert str(damaged) in text and "damaged" in text and "\n" not in text
    assert not (states_dir / damaged.name).exists()  # the checkpoint's folder never got it
    assert not list(states_dir.glob("*.tmp"))


def test_a_damaged_copy_already_in_the_checkpoint_folder_is_replaced_by_the_intact_spill_file(tmp_path) -> None:
    store = ClientStateStore(0, tmp_path / "spill")
    store[0], store[1] = _state(0), _state(1)
    spilled = _spill_file(store, 0)
    states_dir = tmp_path / "ckpt" / STATES_DIR
    states_dir.mkdir(parents=True)
    stale = states_dir / spilled.name
    stale.write_bytes(b"x" + spilled.read_bytes()[1:])  # an older, damaged copy under the same name
    payload = client_state_payload(store, states_dir)
    store.close()
    assert_same_state(open_client_states(range(2), None, None, payload, states_dir), {0: _state(0), 1: _state(1)})


def test_no_budget_is_a_plain_dict_and_the_old_checkpoint_layout(tmp_path) -> None:
    states = open_client_states(range(3), None, None)
    assert type(states) is dict and states == {0: {}, 1: {}, 2: {}}
    assert client_state_payload(states, tmp_path) == {"client_states": states}


# ---- runs ------------------------------------------------------------------------------------------
ALGORITHMS = {
    "fedsiam": [
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "ssfl_args.target_sync=false",  # a target net per client
        "ssfl_args.phi_g=1",
    ],
    "fedseal": [
        "data_args.num_server_val=50",
        "model_args.norm=bn",
        "ssfl_args.server_steps=3",
        "ssfl_args.bootstrap_steps=10",
    ],  # the running ensemble per client
    "fedmatch": [
        "ssfl_args.helper_interval=2",
        "train_args.local_steps=2",
        "train_args.learning_rate=0.003",
    ],  # the held sigma / psi per client
}
TINY = 1e-4  # MiB: ~100 bytes, so every state but the one in use spills


def _rows(run_dir):
    return [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def _final(run_dir):
    """The last checkpoint with every spilled client state and server record read back from its file."""
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    states_dir = run_dir / "checkpoints" / STATES_DIR
    states = open_client_states((), None, None, ckpt, states_dir)
    for name, digests in ckpt.get(RECORD_FILES_KEY, {}).items():  # FedMatch's views / client_psi
        held = {"client_states": ckpt["algorithm"][name], FILES_KEY: digests}
        ckpt["algorithm"][name] = open_client_states((), None, None, held, states_dir)
    return ckpt, states


def _records_spilled(run_dir, names) -> None:
    """The checkpoint lists FedMatch's server records by file (at most one, the one in use, inline), files present."""
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    files = ckpt.get(RECORD_FILES_KEY, {})
    assert sorted(files) == sorted(names), f"spilled server records: {sorted(files)}, expected {sorted(names)}"
    for name in names:
        assert files[name] and len(ckpt["algorithm"][name]) <= 1, name
        seen = set(files[name]) | set(ckpt["algorithm"][name])
        assert seen == set(ckpt["algorithm"]["embeddings"]), name  # every seen client's record, once
        for digest in files[name].values():
            assert (run_dir / "checkpoints" / STATES_DIR / f"{digest}.pt").is_file(), name


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_spilling_and_resuming_under_a_budget_give_the_run_without_one(small_config, tmp_path, algorithm) -> None:
    base = [
        f"ssfl_args.algorithm={algorithm}",
        "train_args.client_num_in_total=3",
        "train_args.client_num_per_round=2",
        "train_args.comm_round=3",
        *ALGORITHMS[algorithm],
    ]
    plain = small_config(*base)
    budget = small_config(
        *base, f"device_args.state_memory_mb={TINY}", f"device_args.state_spill_dir={tmp_path / 'sp'}"
    )
    assert budget.fingerprint() == plain.fingerprint()
    full = run_local(plain, run_dir=tmp_path / "full")
    spilled = run_local(budget, run_dir=tmp_path / "spilled")
    records = ("client_psi", "views") if algorithm == "fedmatch" else ()  # the server's per-client records
    run_local(budget, run_dir=tmp_path / "resumed", stop_after=1)
    if records:
        _records_spilled(tmp_path / "resumed", records)  # the resume starts from spilled server records
    resumed = run_local(budget, run_dir=tmp_path / "resumed", resume=True)
    run_local(budget, run_dir=tmp_path / "mixed", stop_after=2)  # spilled checkpoint, resumed with no budget
    if records:
        _records_spilled(tmp_path / "mixed", records)
    mixed = run_local(plain, run_dir=tmp_path / "mixed", resume=True)
    run_local(plain, run_dir=tmp_path / "old", stop_after=1)  # the old layout (all inline), resumed under a budget
    old = run_local(budget, run_dir=tmp_path / "old", resume=True)

    ref_ckpt, ref_states = _final(tmp_path / "full")
    assert min(state_size(s) for s in ref_states.values()) > 10 * TINY * 2**20  # every client holds tensors
    for name, result in (("spilled", spilled), ("resumed", resumed), ("mixed", mixed), ("old", old)):
        run_dir = tmp_path / name
        assert result.final_acc == full.final_acc, name
        assert _rows(run_dir) == _rows(tmp_path / "full"), name
        ckpt, states = _final(run_dir)
        assert_same_state(ckpt["algorithm"], ref_ckpt["algorithm"], f"{name}: algorithm")
        assert_same_state(states, ref_states, f"{name}: client_states")
    spilled_ckpt = load_checkpoint(tmp_path / "spilled" / "checkpoints" / "last.pt")
    assert spilled_ckpt[FILES_KEY] and not any(spilled_ckpt["client_states"].values())  # every used state on disk
    if records:
        for name in ("spilled", "resumed", "old"):
            _records_spilled(tmp_path / name, records)
    mixed_ckpt = load_checkpoint(tmp_path / "mixed" / "checkpoints" / "last.pt")
    for ckpt in (ref_ckpt, mixed_ckpt):  # no budget: the old layout, every record inline
        assert FILES_KEY not in ckpt and RECORD_FILES_KEY not in ckpt
        for name in records:
            assert type(ckpt["algorithm"][name]) is dict and len(ckpt["algorithm"][name]) == 3, name
    assert not list((tmp_path / "sp").iterdir())  # every run removed its spill folders


def test_the_default_spill_folder_is_in_the_run_folder_and_goes_at_the_end(small_config, tmp_path, monkeypatch) -> None:
    import fedml_ssfl.runtime.common as common

    cfg_args = ("ssfl_args.algorithm=fedseal", *ALGORITHMS["fedseal"], f"device_args.state_memory_mb={TINY}")
    seen = []
    real = common.open_client_states

    def spy(keys, budget, spill, *rest):
        seen.append((budget, spill))
        return real(keys, budget, spill, *rest)

    monkeypatch.setattr(common, "open_client_states", spy)
    cfg = small_config(*cfg_args, "train_args.comm_round=2")
    result = run_local(cfg, run_dir=tmp_path / "r", stop_after=1)
    (budget, spill) = seen[0]
    assert budget == int(TINY * 2**20) and spill.parent == result.run_dir
    assert not list(result.run_dir.glob(".client_states-*"))
    assert load_checkpoint(result.run_dir / "checkpoints" / "last.pt")[FILES_KEY]
    (result.run_dir / ".client_states-r-stale").mkdir()  # left by a killed run
    run_local(cfg, run_dir=result.run_dir, resume=True)
    assert seen[1][1].parent == result.run_dir and not list(result.run_dir.glob(".client_states-*"))


def test_fedmatch_server_records_take_a_share_of_the_budget_and_spill_in_the_run_folder(
    small_config, tmp_path, monkeypatch
) -> None:
    import fedml_ssfl.runtime.common as common

    seen = []
    real = common.open_client_states

    def spy(keys, budget, spill, *rest):
        seen.append((budget, spill))
        return real(keys, budget, spill, *rest)

    monkeypatch.setattr(common, "open_client_states", spy)
    cfg = small_config("ssfl_args.algorithm=fedmatch", *ALGORITHMS["fedmatch"], f"device_args.state_memory_mb={TINY}")
    run_dir = run_local(cfg, run_dir=tmp_path / "r", stop_after=1).run_dir
    # client states, views, client_psi: a third of the budget each, each spilling into a folder of its own
    assert [b for b, _ in seen] == [int(TINY * 2**20) // 3] * 3
    assert [s.name.split("-")[0] for _, s in seen] == [".client_states", ".server_records", ".server_records"]
    assert len({s for _, s in seen}) == 3 and all(s.parent == run_dir for _, s in seen)
    _records_spilled(run_dir, ("client_psi", "views"))
    assert not list(run_dir.glob(".server_records-*"))  # removed at the end
    (run_dir / ".server_records-r-views-stale").mkdir()  # left by a killed run
    run_local(cfg, run_dir=run_dir, resume=True)
    assert not list(run_dir.glob(".server_records-*")) and not list(run_dir.glob(".client_states-*"))


def test_a_damaged_checkpoint_state_file_refuses_the_resume_naming_it(small_config, tmp_path) -> None:
    cfg = small_config("ssfl_args.algorithm=fedseal", *ALGORITHMS["fedseal"], f"device_args.state_memory_mb={TINY}")
    run_local(cfg, run_dir=tmp_path / "r", stop_after=1)
    path = next((tmp_path / "r" / "checkpoints" / STATES_DIR).glob("*.pt"))
    path.write_bytes(b"x" + path.read_bytes()[1:])
    with pytest.raises(CheckpointError, match=f"client state file {path} does not match"):
        run_local(cfg, run_dir=tmp_path / "r", resume=True)


def test_a_damaged_server_record_file_refuses_the_resume_naming_it(small_config, tmp_path) -> None:
    cfg = small_config("ssfl_args.algorithm=fedmatch", *ALGORITHMS["fedmatch"], f"device_args.state_memory_mb={TINY}")
    run_local(cfg, run_dir=tmp_path / "r", stop_after=1)
    ckpt = load_checkpoint(tmp_path / "r" / "checkpoints" / "last.pt")
    digest = next(iter(ckpt[RECORD_FILES_KEY]["views"].values()))
    assert digest not in set(ckpt.get(FILES_KEY, {}).values())  # a file only the server's record names
    path = tmp_path / "r" / "checkpoints" / STATES_DIR / f"{digest}.pt"
    path.write_bytes(b"x" + path.read_bytes()[1:])
    with pytest.raises(CheckpointError, match=f"client state file {path} does not match"):
        run_local(cfg, run_dir=tmp_path / "r", resume=True)
    assert not list((tmp_path / "r").glob(".server_records-*")) and not list((tmp_path / "r").glob(".client_states-*"))


def _damage_between_rounds(monkeypatch, at: int, files) -> list:
    """Make the local runtime damage ``files()`` in place at round ``at`` (0-based): after its client updates
    when ``files`` are spill files (before the round's checkpoint), before them for checkpoint files."""
    import fedml_ssfl.runtime.local as local

    real, damaged = local.run_round, []

    def run_round(exp, r, client_states):
        if r == at and files.__name__ == "checkpoint_files":
            damaged.extend(files())
            for path in damaged:
                _damage_in_place(path)
        row = real(exp, r, client_states)
        if r == at and files.__name__ == "spill_files":
            damaged.extend(files())
            for path in damaged:
                _damage_in_place(path)
        return row

    monkeypatch.setattr(local, "run_round", run_round)
    return damaged


def test_a_spill_file_damaged_mid_run_stops_the_run_and_the_last_good_checkpoint_resumes(
    small_config, tmp_path, monkeypatch
) -> None:
    from fedml_ssfl.runtime.common import RunFailed

    args = ["ssfl_args.algorithm=fedseal", *ALGORITHMS["fedseal"], "train_args.client_num_in_total=3"]
    args += ["train_args.client_num_per_round=2", "train_args.comm_round=3", f"device_args.state_memory_mb={TINY}"]
    cfg = small_config(*args)
    full = run_local(cfg, run_dir=tmp_path / "full")
    run_dir = tmp_path / "r"

    def spill_files():
        return sorted(run_dir.glob(".client_states-*/*.pt"))

    damaged = _damage_between_rounds(monkeypatch, 1, spill_files)
    with pytest.raises(RunFailed) as err:
        run_local(cfg, run_dir=run_dir)
    text = str(err.value)
    assert damaged and any(str(p) in text for p in damaged) and "\n" not in text, text
    assert f"Last good checkpoint: {run_dir / 'checkpoints' / 'last.pt'}" in text, text
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["round"] == 0  # round 2 was never committed
    monkeypatch.undo()
    resumed = run_local(cfg, run_dir=run_dir, resume=True)  # the last good checkpoint really is good
    assert resumed.final_acc == full.final_acc and _rows(run_dir) == _rows(tmp_path / "full")
    assert_same_state(_final(run_dir)[1], _final(tmp_path / "full")[1], "client_states")


def test_a_damaged_checkpoint_file_read_mid_run_is_not_called_a_good_checkpoint(
    small_config, tmp_path, monkeypatch
) -> None:
    from fedml_ssfl.runtime.common import RunFailed

    args = ["ssfl_args.algorithm=fedseal", *ALGORITHMS["fedseal"], "train_args.client_num_in_total=3"]
    args += ["train_args.client_num_per_round=2", "train_args.comm_round=3", f"device_args.state_memory_mb={TINY}"]
    run_dir = tmp_path / "r"

    def checkpoint_files():
        return sorted((run_dir / "checkpoints" / STATES_DIR).glob("*.pt"))

    _damage_between_rounds(monkeypatch, 1, checkpoint_files)
    with pytest.raises(RunFailed) as err:
        run_local(small_config(*args), run_dir=run_dir)
    text = str(err.value)
    assert f"client state file {run_dir / 'checkpoints' / STATES_DIR}" in text and "\n" not in text, text
    assert "Last good checkpoint" not in text and "names that file too" in text, text


@pytest.mark.parametrize("algorithm", ["fedseal", "fedmatch"])
def test_the_fedml_server_keeps_states_under_a_budget_with_the_same_results(small_config, tmp_path, algorithm) -> None:
    from tests.test_fedml_backend import FEDSEAL, run_protocol

    args = FEDSEAL if algorithm == "fedseal" else [f"ssfl_args.algorithm={algorithm}", *ALGORITHMS[algorithm]]
    args = [*args, "train_args.client_num_per_round=2", "train_args.comm_round=3", "tracking_args.checkpoint_every=1"]
    plain = small_config(*args)
    budget = small_config(*args, f"device_args.state_memory_mb={TINY}")
    local = run_local(plain, run_dir=tmp_path / "local")
    workers: dict = {}
    run_protocol(budget, tmp_path / "fed", stop_after=2, workers_out=workers)
    # each pooled worker's cache of the silos it served is bounded too: states beyond it went to disk
    caches = [w.cache for w in workers.values()]
    assert all(isinstance(c, ClientStateStore) for c in caches) and sum(c.spills for c in caches) > 0
    spilled = load_checkpoint(tmp_path / "fed" / "checkpoints" / "last.pt")
    assert spilled[FILES_KEY] and not any(spilled["client_states"].values())  # the server's states on disk
    if algorithm == "fedmatch":  # and the algorithm's records, which the server aggregator holds
        _records_spilled(tmp_path / "fed", ("client_psi", "views"))
    fed, _, _ = run_protocol(budget, tmp_path / "fed", resume=True)
    assert fed.final_acc == local.final_acc and _rows(tmp_path / "fed") == [
        {**r, **{k: v for k, v in f.items() if k.startswith(("wire_", "state_bytes"))}}
        for r, f in zip(_rows(tmp_path / "local"), _rows(tmp_path / "fed"))
    ]
    a, a_states = _final(tmp_path / "local")
    b, b_states = _final(tmp_path / "fed")
    assert_same_state(b["algorithm"], a["algorithm"], "algorithm")
    assert_same_state(b_states, a_states, "client_states")
    assert not list((tmp_path / "fed").glob(".client_states-*"))
    assert not list((tmp_path / "fed").glob(".server_records-*"))
