#!/usr/bin/env bash
# Start the server (rank 0) of a GRPC cross-silo job on this host.
#
#   deploy/start_server.sh CONFIG [IPCONFIG] [fedml-ssfl run options...]
#
# CONFIG has comm_args.backend: GRPC; IPCONFIG (default: the config's comm_args.grpc_ipconfig_path)
# is FedML's CSV eid,rank,grpc_server_ip,grpc_server_port with one row per rank 0..C_k; this host
# must own the address of rank 0. Start order does not matter: every process waits up to
# FEDML_SSFL_CONNECT_TIMEOUT seconds (300) for the others. DRY_RUN=1 prints the command.
set -euo pipefail
[[ $# -ge 1 ]] || { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
CONFIG=$1; shift
ARGS=(run --cf "$CONFIG" --rank 0 --role server)
if [[ $# -gt 0 && "$1" != -* ]]; then ARGS+=(--set "comm_args.grpc_ipconfig_path=$1"); shift; fi
CMD=("${FEDML_SSFL:-fedml-ssfl}" "${ARGS[@]}" "$@")
if [[ "${DRY_RUN:-0}" != "0" ]]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
