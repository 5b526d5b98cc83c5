#!/usr/bin/env bash
# Build the FedML launch packages of deploy/job.yaml with FedML's own build, after checking them for keys.
#
#   deploy/build_launch.sh [DEST]
#
# DEST (default ~/.fedml_ssfl/launch-packages, outside the repository) receives client-package.zip and
# server-package.zip. First every file FedML's build would pack (the workspace minus the names the
# repository's .gitignore lists: deploy/launch_files.py --list) is read: one that looks like a private
# key (a PEM or OpenSSH private key block, a PuTTY key, a PKCS#12 bundle, 64 hex digits of a job key)
# stops the build with one line naming it, and nothing is built. Keys and certificates belong on each
# host, not in a package (docs/deploy.md, section 5). Then `fedml federate build deploy/job.yaml -d DEST`,
# offline.
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; }
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${1:-$HOME/.fedml_ssfl/launch-packages}
FEDML=$(command -v fedml || true)
[[ -n "$FEDML" ]] || { echo "fedml-ssfl: error: build_launch.sh: fedml not on PATH (activate the venv: . .venv/bin/activate)" >&2; exit 2; }
PYTHON=${PYTHON:-$(dirname "$FEDML")/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
"$PYTHON" "$HERE/launch_files.py" "$HERE/job.yaml" --check
exec "$FEDML" federate build "$HERE/job.yaml" -d "$DEST"
