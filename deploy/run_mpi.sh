#!/usr/bin/env bash
# Launch a fedml_ssfl FedML cross-silo job (comm_args.backend: MPI) with mpirun.
#
#   deploy/run_mpi.sh CONFIG [--hostfile FILE] [--gpu-mapping FILE --gpu-key KEY]
#                            [--set section.key=value ...] [--resume RUN_DIR] [-- MPIRUN_ARGS...]
#
# -np is computed from the config: C_k + 1 (train_args.client_num_per_round workers + the server; device_args.worker_num + 1 when it is below C_k), or
# K + 1 in comm_args.mode deployment (one process per silo + the server).
# --hostfile        an Open MPI hostfile (see deploy/hostfile.example); ranks fill hosts in order.
# --gpu-mapping/--gpu-key
#                   a FedML GPU-mapping YAML (deploy/gpu_mapping.yaml) and the key to use: sets
#                   device_args.device=cuda and pins every rank to its GPU; checked before launch.
# --set, --resume   passed to `fedml-ssfl run` (overrides are also used to compute -np).
# after --          extra mpirun arguments, e.g. -- --mca btl_tcp_if_include eth0
#
# Environment: MPIRUN (default: the mpirun next to fedml-ssfl, else on PATH), PYTHON (the
# interpreter that has fedml_ssfl), MPI_BIND (--bind-to policy, default none: every rank runs
# multi-threaded torch), DRY_RUN=1 prints the command instead of running it.
# FEDML_SSFL_* variables (timeouts, offline guard) are exported to every rank.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-2}"; }
[[ $# -ge 1 ]] || usage
case "$1" in -h|--help) usage 0 ;; esac
CONFIG=$1; shift
[[ -f "$CONFIG" ]] || { echo "run_mpi.sh: config not found: $CONFIG" >&2; exit 2; }

HOSTFILE="" GPU_MAP="" GPU_KEY=""
SETS=() RUN_ARGS=() MPI_EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hostfile) HOSTFILE=$2; shift 2 ;;
    --gpu-mapping) GPU_MAP=$2; shift 2 ;;
    --gpu-key) GPU_KEY=$2; shift 2 ;;
    --set) SETS+=("$2"); shift 2 ;;
    --resume) RUN_ARGS+=(--resume "$2"); shift 2 ;;
    --) shift; MPI_EXTRA=("$@"); break ;;
    -h|--help) usage 0 ;;
    *) echo "run_mpi.sh: unknown argument $1" >&2; usage ;;
  esac
done
if [[ -n "$GPU_MAP" || -n "$GPU_KEY" ]]; then
  [[ -n "$GPU_MAP" && -n "$GPU_KEY" ]] || { echo "run_mpi.sh: --gpu-mapping and --gpu-key go together" >&2; exit 2; }
  SETS+=("device_args.device=cuda" "device_args.gpu_mapping_file=$GPU_MAP" "device_args.gpu_mapping_key=$GPU_KEY")
fi

FEDML_SSFL=$(command -v fedml-ssfl || true)
[[ -n "$FEDML_SSFL" ]] || { echo "run_mpi.sh: fedml-ssfl not on PATH (activate the venv: . .venv/bin/activate)" >&2; exit 2; }
BIN_DIR=$(dirname "$FEDML_SSFL")
PYTHON=${PYTHON:-$BIN_DIR/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
if [[ -z "${MPIRUN:-}" ]]; then
  if [[ -x "$BIN_DIR/mpirun" ]]; then MPIRUN=$BIN_DIR/mpirun; else MPIRUN=mpirun; fi
fi

# Validate the config (and the GPU mapping) and compute -np = C_k + 1 with the package itself.
NP=$("$PYTHON" - "$CONFIG" "${SETS[@]}" <<'PY'
import sys
from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.runtime.fedml.launch import gpu_for_rank, world_size
try:
    cfg = load_config(sys.argv[1], ["%s" % s for s in sys.argv[2:]])
    if cfg.comm_args.backend != "MPI" or cfg.common_args.training_type != "cross_silo":
        raise ConfigError(f"{sys.argv[1]}: run_mpi.sh needs comm_args.backend MPI and common_args.training_type "
                          f"cross_silo (got {cfg.comm_args.backend} / {cfg.common_args.training_type})")
    n = world_size(cfg)
    d = cfg.device_args
    if d.gpu_mapping_file:
        for rank in range(n):
            gpu_for_rank(d.gpu_mapping_file, d.gpu_mapping_key, rank, n)
except ConfigError as exc:
    sys.exit(f"run_mpi.sh: {exc}")
print(n)
PY
)

# Each rank runs multi-threaded torch: do not pin it to one core (MPI_BIND=core etc. to change).
CMD=("$MPIRUN" -np "$NP" --bind-to "${MPI_BIND:-none}")
if [[ -n "$HOSTFILE" ]]; then
  [[ -f "$HOSTFILE" ]] || { echo "run_mpi.sh: hostfile not found: $HOSTFILE" >&2; exit 2; }
  CMD+=(--hostfile "$HOSTFILE")
elif [[ "$NP" -gt "$(nproc 2>/dev/null || echo 1)" ]]; then
  CMD+=(--oversubscribe)  # one host with fewer cores than processes
fi
if [[ $EUID -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
for var in $(compgen -e | grep '^FEDML_SSFL_' || true); do CMD+=(-x "$var"); done
CMD+=("${MPI_EXTRA[@]}" "$FEDML_SSFL" run --cf "$CONFIG")
for s in "${SETS[@]}"; do CMD+=(--set "$s"); done
CMD+=("${RUN_ARGS[@]}")

if [[ "${DRY_RUN:-0}" != "0" ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
exec "${CMD[@]}"
