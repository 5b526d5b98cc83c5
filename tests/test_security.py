"""Sealed envelopes, the job key, TLS settings and membership (fedml_ssfl.runtime.fedml.security), without
processes; the GRPC tests run the same checks between real processes."""

from __future__ import annotations

import pytest

from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.runtime.fedml.security import (
    BEAT,
    HELLO,
    KEY_ENV,
    Duplicate,
    JobSecurity,
    NotAdmitted,
    Opener,
    Refused,
    Sealer,
    job_identity,
    load_security,
    membership,
    membership_diff,
    proof,
)

KEY = b"k" * 64


def pair(key: bytes | None = KEY, job: str = "job-1", admitted: bool = True) -> tuple[Sealer, Opener]:
    sec = JobSecurity(job=job, key=key, tls=None)
    sealer, opener = Sealer(sec, 1), Opener(sec, 0, {1, 2}, limit=10_000)
    if admitted:
        opener.admit(1, sealer.session)
    return sealer, opener


def test_a_sealed_message_opens_to_its_sender_session_and_payload():
    sealer, opener = pair()
    opened = opener.open(sealer.seal(0, b"payload"))
    assert opened.sender == 1 and bytes(opened.payload) == b"payload"
    assert opened.session == sealer.session and len(sealer.session) == 32 and opened.kind == "m"


def test_only_handshakes_pass_before_a_session_is_admitted_and_an_admission_replaces_the_session():
    sealer, opener = pair(admitted=False)
    assert opener.open(sealer.seal(0, b"online", HELLO)).kind == HELLO
    for kind in ("m", BEAT):
        with pytest.raises(NotAdmitted, match="has not completed the handshake"):
            opener.open(sealer.seal(0, b"x", kind))
    opener.admit(1, sealer.session)
    assert opener.open(sealer.seal(0, b"x")).sender == 1
    restarted = Sealer(sealer.security, 1)  # rank 1 again, a new process: refused until admitted
    with pytest.raises(NotAdmitted):
        opener.open(restarted.seal(0, b"x"))
    assert opener.admit(1, restarted.session) == sealer.session
    assert bytes(opener.open(restarted.seal(0, b"y")).payload) == b"y"
    with pytest.raises(NotAdmitted):  # the old process is not heard any more
        opener.open(sealer.seal(0, b"z"))


def test_the_job_identity_is_the_run_id_or_a_digest_of_the_key_never_empty():
    cfg = grpc_cfg()
    a, b = job_identity(cfg, KEY), job_identity(cfg, b"o" * 64)
    assert a.startswith("job-") and len(a) > 20 and a != b
    assert job_identity(grpc_cfg("common_args.random_seed=3"), KEY) == a  # the handshake names that
    assert job_identity(grpc_cfg("common_args.run_id=r7"), KEY) == "r7"
    assert job_identity(cfg, None).startswith("job-")


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
        with pytest.raises(Duplicate, match="replayed: rank 1's message"):
            opener.open(again)
    hello = sealer.seal(0, b"h", HELLO)
    opener.open(hello)
    with pytest.raises(Duplicate):  # handshake envelopes too, within their session
        opener.open(hello)


def test_a_second_process_claiming_a_rank_is_refused():
    sealer, opener = pair()
    opener.open(sealer.seal(0, b"a"))
    impostor = Sealer(sealer.security, 1)  # same key, same rank, another process, not admitted
    with pytest.raises(NotAdmitted):
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
    assert opener.open(data).sender == 1
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


def test_the_job_key_file_is_read_per_rank_like_the_tls_files(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    (tmp_path / "job1.key").write_text("a" * 40)
    (tmp_path / "job2.key").write_text("b" * 40)
    cfg = grpc_cfg("comm_args.insecure=true", f"comm_args.job_key_file={tmp_path / 'job{rank}.key'}")
    assert load_security(cfg, 1).key == b"a" * 40
    assert load_security(cfg, 2).key == b"b" * 40
    with pytest.raises(ConfigError, match=r"comm_args\.job_key_file: cannot read .*job3\.key"):
        load_security(cfg, 3)


def test_membership_ignores_local_keys_and_names_what_differs():
    a = grpc_cfg("common_args.output_dir=/a", "device_args.device=cpu", "comm_args.tls_cert=/x")
    b = grpc_cfg("common_args.output_dir=/b", "common_args.random_seed=4", "comm_args.tls_cert=/y")
    assert membership_diff(membership(a), membership(a), 2) == []
    assert membership_diff(membership(a), membership(b), 2) == ["common_args.random_seed (server 0, rank 2 4)"]
    assert membership_diff(membership(a), None, 2)[0].startswith("(no config sent")


def test_the_key_proof_binds_key_job_rank_config_challenge_and_session():
    cfg = membership(grpc_cfg())
    p = proof(KEY, "job", 1, cfg, "c1", "s1")
    assert p == proof(KEY, "job", 1, cfg, "c1", "s1") and len(p) == 64
    assert p not in {
        proof(b"o" * 64, "job", 1, cfg, "c1", "s1"),
        proof(KEY, "job", 2, cfg, "c1", "s1"),
        proof(KEY, "other", 1, cfg, "c1", "s1"),
        proof(KEY, "job", 1, cfg, "c2", "s1"),  # another challenge: an answer captured earlier
        proof(KEY, "job", 1, cfg, "c1", "s2"),  # another process
    }
    assert proof(None, "job", 1, cfg, "c1", "s1") == ""
