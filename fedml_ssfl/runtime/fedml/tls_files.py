"""The GRPC job's TLS files checked for what they are, before a port is bound.

gRPC reads the PEM files only when the server binds its port, and a file it cannot use (a junk
CA, a certificate and key swapped, a key that is not the certificate's) then fails the bind like a
port in use. :func:`check_tls_files` refuses each in one line naming the config key, the file and
the fix, with OpenSSL's own reading (Python's :mod:`ssl`; no other dependency).
"""

from __future__ import annotations

import re
import ssl

from ...config import ConfigError, ExperimentConfig
from ...limits import read_small_file
from .security import pem_path

_FIX = "make a test CA with deploy/make_test_certs.sh, or point the key at your PEM file"
_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_CERT = b"-----BEGIN CERTIFICATE-----"


def check_tls_files(cfg: ExperimentConfig, rank: int) -> None:
    """Refuse ``comm_args.tls_ca`` / ``tls_cert`` / ``tls_key`` (for ``rank``) that OpenSSL cannot use together.

    Nothing is checked for a plaintext job (``comm_args.insecure``) or where the keys are unset
    (:func:`.security.load_security` names those). The CA must hold a certificate, the certificate
    a certificate and the key a private key (a swapped pair is named as such), and the key must be
    the certificate's.

    Raises
    ------
    ConfigError
        Naming the key, the file and the fix.
    """
    c = cfg.comm_args
    if c.insecure or not (c.tls_ca and c.tls_cert and c.tls_key):
        return
    ca, cert, key = (pem_path(p, rank) for p in (c.tls_ca, c.tls_cert, c.tls_key))
    data = {}
    for name, path in (("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)):
        data[name] = read_small_file(path, f"comm_args.{name}", _FIX)  # bounded: /dev/zero is refused unread
    if _KEY.search(data["tls_cert"]) and _CERT in data["tls_key"]:
        raise ConfigError(
            f"comm_args.tls_cert {cert} holds a private key and comm_args.tls_key {key} a certificate: the two are "
            "swapped; swap the paths"
        )
    for name, path in (("tls_ca", ca), ("tls_cert", cert)):
        if _CERT not in data[name]:
            raise ConfigError(f"comm_args.{name}: {path} holds no PEM certificate ({_CERT.decode()}); {_FIX}")
    if not _KEY.search(data["tls_key"]):
        raise ConfigError(f"comm_args.tls_key: {key} holds no PEM private key (-----BEGIN PRIVATE KEY-----); {_FIX}")
    for name, path in (("tls_ca", ca), ("tls_cert", cert)):  # each read alone: a junk certificate is named as such
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data[name].decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            reason = _reason(exc)
            raise ConfigError(
                f"comm_args.{name}: {path} is not a certificate OpenSSL can read ({reason}); {_FIX}"
            ) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # an encrypted key fails instead of prompting
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ConfigError(
                f"comm_args.tls_key {key} is not the private key of comm_args.tls_cert {cert}; pass the key made with "
                "that certificate"
            ) from None
        if b"ENCRYPTED" in data["tls_key"]:
            raise ConfigError(
                f"comm_args.tls_key: {key} is an encrypted private key ({_reason(exc)}); gRPC takes an unencrypted "
                f"one: decrypt it (openssl pkey -in {key} -out KEY.pem) and pass that"
            ) from None
        raise ConfigError(
            f"comm_args.tls_key: {key} is not a private key OpenSSL can read ({_reason(exc)}); {_FIX}"
        ) from None


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "reason", None) or exc).strip() or type(exc).__name__
