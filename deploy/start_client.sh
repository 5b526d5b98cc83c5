#!/usr/bin/env bash
# Start client RANK (1..C_k) of a GRPC cross-silo job on this host.
#
#   deploy/start_client.sh CONFIG RANK [IPCONFIG] [fedml-ssfl run options...]
#
# Same CONFIG and IPCONFIG on every host; this host must own the address of RANK in IPCONFIG.
# The worker trains whichever data silo the server assigns it each round, and exits when the
# server ends the run. DRY_RUN=1 prints the command.
set -euo pipefail
[[ $# -ge 2 ]] || { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
CONFIG=$1 RANK=$2; shift 2
[[ "$RANK" =~ ^[1-9][0-9]*$ ]] || { echo "start_client.sh: RANK must be 1..C_k (0 is the server), got $RANK" >&2; exit 2; }
ARGS=(run --cf "$CONFIG" --rank "$RANK" --role client)
if [[ $# -gt 0 && "$1" != -* ]]; then ARGS+=(--set "comm_args.grpc_ipconfig_path=$1"); shift; fi
CMD=("${FEDML_SSFL:-fedml-ssfl}" "${ARGS[@]}" "$@")
if [[ "${DRY_RUN:-0}" != "0" ]]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
