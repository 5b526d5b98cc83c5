"""Sealed envelopes, the job key, TLS settings and membership (fedml_ssfl.runtime.fedml.security), without
processes; the GRPC tests run the same checks between real processes."""

from __future__ import annotations

import pytest

from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.runtime.fedml.security import (
    KEY_ENV,
    JobSecurity,
    Opener,
    Refused,
    Sealer,
    load_security,
    membership,
    membership_diff,
    proof,
)

KEY = b"k" * 64


def pair(key: bytes | None = KEY, job: str = "job-1") -> tuple[Sealer, Opener]:
    sec = JobSecurity(job=job, key=key, tls=None)
    return Sealer(sec, 1), Opener(sec, 0, {1, 2}, limit=10_000)


def test_a_sealed_message_opens_to_its_sender_and_payload():
    sealer, opener = pair()
    sender, payload = opener.open(sealer.seal(0, b"payload"))
    assert sender == 1 and bytes(payload) == b"payload"


@pytest.mark.parametrize("position", [0, 20, 40, -40, -1])
def test_any_flipped_byte_is_refused(position):
    sealer, opener = pair()
    data = bytearray(sealer.seal(0, b"p" * 64))
    data[position] ^= 1
    with pytest.raises(Refused):
        opener.open(bytes(data))


def test_a_message_sealed_with_another_key_is_refused_as_a_bad_tag():
    stranger = Sealer(JobSecurity(job="job-1", key=b"o" * 64, tls=None), 1)
    with pytest.raises(Refused, match="bad tag"):
        pair()[1].open(stranger.seal(0, b"x"))


def test_a_replay_is_refused_even_out_of_order():
    sealer, opener = pair()
    first, second = sealer.seal(0, b"a"), sealer.seal(0, b"b")
    opener.open(second)
    opener.open(first)  # late, but new
    for again in (first, second):
        with pytest.raises(Refused, match="replayed: rank 1's message"):
            opener.open(again)


def test_a_second_process_claiming_a_rank_is_refused():
    sealer, opener = pair()
    opener.open(sealer.seal(0, b"a"))
    impostor = Sealer(sealer.security, 1)  # same key, same rank, another process
    with pytest.raises(Refused, match="a second process claims rank 1"):
        opener.open(impostor.seal(0, b"a"))


def test_unknown_rank_wrong_receiver_other_job_and_oversized_are_refused():
    _, opener = pair()
    with pytest.raises(Refused, match="unknown rank 7"):
        opener.open(Sealer(JobSecurity("job-1", KEY, None), 7).seal(0, b"x"))
    with pytest.raises(Refused, match="addressed to rank 2"):
        opener.open(Sealer(JobSecurity("job-1", KEY, None), 1).seal(2, b"x"))
    with pytest.raises(Refused, match="from another job"):
        opener.open(Sealer(JobSecurity("job-2", KEY, None), 1).seal(0, b"x"))
    with pytest.raises(Refused, match="oversized"):
        opener.open(Sealer(JobSecurity("job-1", KEY, None), 1).seal(0, b"x" * 20_000))
    with pytest.raises(Refused, match="not a sealed message"):
        opener.open(b"\x80\x04 a pickle")


def test_without_a_key_envelopes_still_carry_rank_and_replay_checks():
    sealer, opener = pair(key=None)
    data = sealer.seal(0, b"a")
    assert opener.open(data)[0] == 1
    with pytest.raises(Refused, match="replayed"):
        opener.open(data)


def grpc_cfg(*overrides: str):
    return load_config(None, ["common_args.training_type=cross_silo", "comm_args.backend=GRPC", *overrides])


def test_grpc_without_tls_or_key_is_refused_naming_the_keys(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"comm_args\.tls_ca, comm_args\.tls_cert, comm_args\.tls_key.*insecure"):
        load_security(grpc_cfg(), 0)


def test_plaintext_only_when_asked_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(KEY_ENV, "e" * 40)
    sec = load_security(grpc_cfg("comm_args.insecure=true"), 1)
    assert sec.insecure and sec.key == b"e" * 40
    assert "plaintext" in caplog.text


def test_tls_files_are_read_per_rank_and_a_missing_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    for name in ("ca.pem", "rank3.pem", "rank3.key"):
        (tmp_path / name).write_text(f"-----{name}-----")
    (tmp_path / "job.key").write_text("j" * 64 + "\n")
    keys = [
        f"comm_args.tls_ca={tmp_path / 'ca.pem'}",
        f"comm_args.tls_cert={tmp_path / 'rank{rank}.pem'}",
        f"comm_args.tls_key={tmp_path / 'rank{rank}.key'}",
        f"comm_args.job_key_file={tmp_path / 'job.key'}",
    ]
    sec = load_security(grpc_cfg(*keys), 3)
    assert sec.tls.cert == b"-----rank3.pem-----" and sec.key == b"j" * 64
    with pytest.raises(ConfigError, match=r"comm_args\.tls_cert: cannot read .*rank2\.pem"):
        load_security(grpc_cfg(*keys), 2)
    (tmp_path / "job.key").write_text("short")
    with pytest.raises(ConfigError, match="at least 32"):
        load_security(grpc_cfg(*keys), 3)


def test_membership_ignores_local_keys_and_names_what_differs():
    a = grpc_cfg("common_args.output_dir=/a", "device_args.device=cpu", "comm_args.tls_cert=/x")
    b = grpc_cfg("common_args.output_dir=/b", "common_args.random_seed=4", "comm_args.tls_cert=/y")
    assert membership_diff(membership(a), membership(a), 2) == []
    assert membership_diff(membership(a), membership(b), 2) == ["common_args.random_seed (server 0, rank 2 4)"]
    assert membership_diff(membership(a), None, 2)[0].startswith("(no config sent")


def test_the_key_proof_binds_key_job_rank_and_config():
    cfg = membership(grpc_cfg())
    p = proof(KEY, "job", 1, cfg)
    assert p == proof(KEY, "job", 1, cfg) and len(p) == 64
    assert p not in {proof(b"o" * 64, "job", 1, cfg), proof(KEY, "job", 2, cfg), proof(KEY, "other", 1, cfg)}
    assert proof(None, "job", 1, cfg) == ""
