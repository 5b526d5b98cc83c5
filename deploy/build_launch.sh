#!/usr/bin/env bash
# Stage a FedML launch job's workspace from its allow-list, check it, and build its packages with FedML.
#
#   deploy/build_launch.sh [JOB.yaml] [DEST]
#
# JOB.yaml (default deploy/job.yaml; deploy/launch_script/job.yaml for your own FedMLRunner script)
# has `workspace: launch_workspace`. First that folder beside it is deleted and filled with exactly the
# files job_files.txt beside it names and fedml_ssfl's own modules (deploy/launch_files.py --stage;
# --list prints them): nothing else, whatever its name, can reach a package. Then every staged file
# is read: one that holds a private key (a PEM or OpenSSH private key block, a PuTTY key, a PKCS#12
# bundle, 64 hex digits of a job key) stops the build with one line naming it. Then
# `fedml federate build JOB.yaml -d DEST`, offline: DEST (default ~/.fedml_ssfl/launch-packages,
# outside the repository) receives dist-packages/client-package.zip and server-package.zip.
# `fedml launch JOB.yaml` afterwards packs the same staged folder: build again after every edit.
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; }
HERE=$(cd "$(dirname "$0")" && pwd)
JOB=$HERE/job.yaml
if [[ "${1:-}" == *.yaml || "${1:-}" == *.yml ]]; then JOB=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); shift; fi
DEST=${1:-$HOME/.fedml_ssfl/launch-packages}
FEDML=$(command -v fedml || true)
[[ -n "$FEDML" ]] || { echo "fedml-ssfl: error: build_launch.sh: fedml not on PATH (activate the venv: . .venv/bin/activate)" >&2; exit 2; }
PYTHON=${PYTHON:-$(dirname "$FEDML")/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
"$PYTHON" "$HERE/launch_files.py" "$JOB" --stage
"$PYTHON" "$HERE/launch_files.py" "$JOB" --check
exec "$FEDML" federate build "$JOB" -d "$DEST"
