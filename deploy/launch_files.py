"""The files `fedml federate build JOB.yaml` packs, and a check that none of them holds a private key.

    python deploy/launch_files.py deploy/job.yaml --list     # one packed file per line, workspace-relative
    python deploy/launch_files.py deploy/job.yaml --check    # exit 2 naming the first file that holds a key

FedML 0.9.6's build (``FedMLJobConfig``, ``FedMLLaunchManager._build_job_package``) copies the job's
``workspace`` (relative to the job YAML's folder) leaving out every file or folder whose name matches
a line of the workspace's ``.gitignore`` (comments and blank lines skipped; FedML's own list where the
file has none) or of FedML's fixed list below, at any depth, as ``shutil.ignore_patterns`` does; this
reads the same files the same way, without importing FedML (tests/test_deploy.py compares the list
with the packages FedML builds). ``--check`` reads each of them: a PEM or OpenSSH private key block,
a PuTTY key, a PKCS#12 bundle or a file of 64 hex digits (a job key) stops it with one line.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
from pathlib import Path

import yaml

FEDML_PRE_IGNORE = "dist-packages,client-package.zip,server-package.zip,__pycache__,*.pyc,*.git, *venv"
"""FedML 0.9.6's ``Constants.FEDML_MLOPS_BUILD_PRE_IGNORE_LIST``, added to every build's ignore list."""

PRIVATE_BLOCK = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|PuTTY-User-Key-File-[0-9]+:")
JOB_KEY = re.compile(rb"\s*[0-9a-fA-F]{64}\s*")


def packed_files(job_yaml: str | Path) -> tuple[Path, list[Path]]:
    """The job's workspace and the files FedML's build packs from it (sorted, relative)."""
    job = Path(job_yaml).resolve()
    spec = yaml.safe_load(job.read_text(encoding="utf-8")) or {}
    root = Path(os.path.normpath(job.parent / str(spec.get("workspace") or ".")))
    lines = []
    gitignore = root / ".gitignore"
    if gitignore.is_file():
        lines = [x.strip("\n") for x in gitignore.read_text(encoding="utf-8").splitlines()]
        lines = [x for x in lines if x.strip() and not x.startswith("#")]
    listed = ",".join(lines) if lines else FEDML_PRE_IGNORE
    patterns = [p for p in f"{listed},{FEDML_PRE_IGNORE}".split(",") if p]
    out = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, p) for p in patterns))
        out += [Path(top, f).relative_to(root) for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    return root, sorted(out)


def private_content(path: Path) -> str | None:
    """What makes ``path`` look like a private key, or None."""
    if path.suffix.lower() in (".p12", ".pfx"):
        return "a PKCS#12 bundle"
    try:
        with path.open("rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return None
    if PRIVATE_BLOCK.search(head):
        return "a private key block"
    if JOB_KEY.fullmatch(head):
        return "64 hex digits, a job key"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("--list", "--check"):
        print(__doc__.strip().splitlines()[2:4][0].strip(), file=sys.stderr)
        return 2
    root, files = packed_files(argv[0])
    if argv[1] == "--list":
        print("\n".join(str(f) for f in files))
        return 0
    for rel in files:
        what = private_content(root / rel)
        if what:
            print(
                f"fedml-ssfl: error: build_launch.sh: refusing to build: {rel} would be packed and holds {what}; "
                "keys belong on each host (docs/deploy.md, section 5): move it out of the repository",
                file=sys.stderr,
            )
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
