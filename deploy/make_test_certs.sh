#!/usr/bin/env bash
# Make a TEST certificate authority, one certificate per rank, and a job key, for a GRPC job.
#
#   deploy/make_test_certs.sh OUT_DIR WORLD [SAN ...]
#
# WORLD is the number of processes (C_k + 1; rank 0 is the server). Writes, in OUT_DIR:
#   ca.pem                      the CA certificate every party trusts (comm_args.tls_ca)
#   rank0.pem, rank0.key, ...   one certificate and private key per rank, signed by the CA
#                               (comm_args.tls_cert: OUT_DIR/rank{rank}.pem, tls_key: OUT_DIR/rank{rank}.key)
#   job.key                     32 random bytes, hex: the job's shared HMAC key (comm_args.job_key_file)
# Each certificate names the SANs given (default: IP:127.0.0.1 DNS:localhost); give the addresses
# of your ipconfig, e.g. IP:10.0.0.1 IP:10.0.0.2 IP:10.0.0.3. The CA key is deleted after signing.
# For a test or a trial only: in production use your organisation's CA.
set -euo pipefail
[[ $# -ge 2 ]] || { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
OUT=$1 WORLD=$2; shift 2
[[ "$WORLD" =~ ^[1-9][0-9]*$ ]] || { echo "make_test_certs.sh: WORLD must be a positive integer, got $WORLD" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make_test_certs.sh: openssl is not installed" >&2; exit 2; }
SANS=("$@"); [[ ${#SANS[@]} -gt 0 ]] || SANS=(IP:127.0.0.1 DNS:localhost)
SAN=$(IFS=,; echo "${SANS[*]}")
mkdir -p "$OUT"; chmod 700 "$OUT"
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
  -subj "/CN=fedml_ssfl test CA" -keyout "$OUT/ca.key" -out "$OUT/ca.pem" 2>/dev/null
for ((rank = 0; rank < WORLD; rank++)); do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=fedml_ssfl rank $rank" \
    -keyout "$OUT/rank$rank.key" -out "$OUT/rank$rank.csr" 2>/dev/null
  openssl x509 -req -in "$OUT/rank$rank.csr" -CA "$OUT/ca.pem" -CAkey "$OUT/ca.key" -CAcreateserial -days 30 \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$SAN") \
    -out "$OUT/rank$rank.pem" 2>/dev/null
  rm -f "$OUT/rank$rank.csr"
done
rm -f "$OUT/ca.key" "$OUT/ca.srl"
openssl rand -hex 32 > "$OUT/job.key"
echo "wrote $OUT: ca.pem, rank0..$((WORLD - 1)).pem/.key, job.key (SAN $SAN)"
