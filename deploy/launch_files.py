"""Stage a FedML launch job's workspace from an allow-list, list it, and check it holds no private key.

    python deploy/launch_files.py deploy/job.yaml --stage    # (re)write the job's launch_workspace/
    python deploy/launch_files.py deploy/job.yaml --list     # the files --stage writes, one a line
    python deploy/launch_files.py deploy/job.yaml --check    # exit 2 naming a staged file that holds a key

FedML 0.9.6's build (``fedml federate build``, and ``fedml launch`` before it uploads) packs the job
YAML's ``workspace`` folder whole, leaving out only names its ignore patterns match. So the job's
``workspace`` is a dedicated folder, ``launch_workspace`` beside the job YAML, that this script fills
with exactly what the job runs and nothing else:

* the files ``job_files.txt`` beside the job YAML lists (its entry script, its config, the ipconfig:
  one path or glob a line, relative to the ``root:`` line's folder), at the same relative paths;
* fedml_ssfl itself under ``fedml_ssfl_src/``: ``setup.py``, ``README.md`` and the files
  ``pip install`` installs (the ``*.py`` modules of the ``fedml_ssfl`` and ``mobile_export``
  packages, and ``fedml_ssfl/configs/*.yaml``).

Anything else (a venv, ``.env``, an ssh key, a token, a data or run folder, whatever its name) is
never copied, so FedML's build cannot pack it. ``--stage`` removes the workspace first, so nothing
left there survives. ``--check`` then reads each staged file: a PEM or OpenSSH private key block, a
PuTTY private key, a PKCS#12 bundle or a file of 64 hex digits (a job key) stops it with one line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import yaml

WORKSPACE = "launch_workspace"
"""The only name a job's ``workspace`` may have: --stage deletes and rewrites that folder."""
ALLOW_LIST = "job_files.txt"
PACKAGE_DIR = "fedml_ssfl_src"
PACKAGES = ("fedml_ssfl", "mobile_export")
PACKAGE_DATA = ("fedml_ssfl/configs/*.yaml",)
PACKAGE_TOP = ("setup.py", "README.md")

# a whole key block (BEGIN, base64 body, END): a source line that merely names the header is not a key
_BODY = rb"[A-Za-z0-9+/=:,\s\\\"'-]*?"  # base64 lines, PEM headers, and \n or quotes where a key sits in source
_PEM_KEY = re.compile(
    rb"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----" + _BODY + rb"[A-Za-z0-9+/]{8}" + _BODY + rb"-----END \1PRIVATE KEY-----"
)
_PUTTY_KEY = re.compile(rb"(?m)^PuTTY-User-Key-File-[0-9]+: .*$[\s\S]*^Private-Lines: [0-9]+")
_JOB_KEY = re.compile(rb"\s*[0-9a-fA-F]{64}\s*")


class LaunchError(Exception):
    """A job that cannot be staged: the message names the file or line and the fix."""


def _fail(msg: str) -> LaunchError:
    return LaunchError(f"fedml-ssfl: error: launch_files.py: {msg}")


def workspace_of(job_yaml: str | Path) -> Path:
    """The job's workspace folder: ``launch_workspace`` beside the job YAML, or an error naming the key."""
    job = Path(job_yaml).resolve()
    if not job.is_file():
        raise _fail(f"{job_yaml}: no such job YAML")
    spec = yaml.safe_load(job.read_text(encoding="utf-8")) or {}
    if spec.get("workspace") != WORKSPACE:
        raise _fail(
            f"{job_yaml}: workspace: {spec.get('workspace')!r}: must be {WORKSPACE} (the folder --stage fills "
            "from job_files.txt, so that FedML's build packs only what the job runs)"
        )
    return job.parent / WORKSPACE


def package_root() -> Path:
    """The fedml_ssfl checkout to pack: the one holding this script, else the one ``fedml_ssfl`` imports from."""
    here = Path(__file__).resolve().parents[1]
    candidates = [here]
    spec = importlib.util.find_spec("fedml_ssfl")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).resolve().parents[1])
    for root in candidates:
        if (root / "setup.py").is_file() and (root / "fedml_ssfl" / "__init__.py").is_file():
            return root
    raise _fail("no fedml_ssfl checkout (setup.py and fedml_ssfl/) next to deploy/ or on the import path")


def package_files(root: Path) -> list[Path]:
    """What ``pip install`` takes from the checkout: setup.py, README.md, the packages' modules and data."""
    out = [Path(n) for n in PACKAGE_TOP if (root / n).is_file()]
    for pkg in PACKAGES:
        for top, dirs, files in os.walk(root / pkg):
            if not (Path(top) / "__init__.py").is_file():
                dirs[:] = []  # not a package: find_packages would not descend
                continue
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [Path(top, f).relative_to(root) for f in sorted(files) if f.endswith(".py")]
    for pattern in PACKAGE_DATA:
        out += sorted(p.relative_to(root) for p in root.glob(pattern) if p.is_file())
    return out


def job_files(job_yaml: str | Path) -> tuple[Path, list[Path]]:
    """The root the job's allow-list is relative to, and the files it names (sorted, relative)."""
    listing = Path(job_yaml).resolve().parent / ALLOW_LIST
    if not listing.is_file():
        raise _fail(f"{listing}: missing: list the files the job runs (its script, config, ipconfig), one a line")
    root, out = listing.parent, []
    for n, raw in enumerate(listing.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("root:"):
            root = (listing.parent / line[5:].strip()).resolve()
            continue
        where = f"{listing.name} line {n}: {line}"
        if Path(line).is_absolute() or ".." in Path(line).parts:
            raise _fail(f"{where}: a path inside the root: line's folder, without .. (it is packed at that path)")
        if Path(line).parts[0] == PACKAGE_DIR:
            raise _fail(f"{where}: {PACKAGE_DIR}/ is the package's place in the workspace: move or rename yours")
        found = sorted(p for p in root.glob(line) if p.is_file())
        if not found:
            raise _fail(f"{where}: no such file under {root}: fix the path or the root: line")
        out += [p.relative_to(root) for p in found]
    if not out:
        raise _fail(f"{listing}: lists no file: name the job's script and config")
    return root, sorted(set(out))


def staged(job_yaml: str | Path) -> list[tuple[Path, Path]]:
    """(source file, path in the workspace) for every file the workspace gets, sorted by the latter."""
    root, files = job_files(job_yaml)
    pairs = [(root / f, f) for f in files]
    pkg = package_root()
    pairs += [(pkg / f, PACKAGE_DIR / f) for f in package_files(pkg)]
    return sorted(pairs, key=lambda p: p[1])


def stage(job_yaml: str | Path) -> Path:
    """Delete the job's workspace and write into it exactly the :func:`staged` files."""
    ws = workspace_of(job_yaml)
    pairs = staged(job_yaml)
    if ws.is_symlink() or ws.is_file():
        ws.unlink()
    elif ws.exists():
        shutil.rmtree(ws)
    for src, rel in pairs:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, ws / rel)
    return ws


def private_content(path: Path) -> str | None:
    """What makes ``path`` look like a private key, or None."""
    if path.suffix.lower() in (".p12", ".pfx"):
        return "a PKCS#12 bundle"
    try:
        with path.open("rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return None
    if _PEM_KEY.search(head) or _PUTTY_KEY.search(head):
        return "a private key block"
    if _JOB_KEY.fullmatch(head):
        return "64 hex digits, a job key"
    return None


def check(job_yaml: str | Path) -> str | None:
    """The first staged file that looks like a key, as one error line, or None."""
    ws = workspace_of(job_yaml)
    if not ws.is_dir():
        return f"fedml-ssfl: error: launch_files.py: {ws}: not staged: run deploy/build_launch.sh {job_yaml}"
    for top, dirs, files in os.walk(ws):
        dirs.sort()
        for name in sorted(files):
            what = private_content(Path(top, name))
            if what:
                rel = Path(top, name).relative_to(ws)
                return (
                    f"fedml-ssfl: error: build_launch.sh: refusing to build: {rel} would be packed and holds {what}; "
                    "keys belong on each host (docs/deploy.md, section 5): take it out of job_files.txt"
                )
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("--stage", "--list", "--check"):
        print("usage: python deploy/launch_files.py JOB.yaml --stage|--list|--check", file=sys.stderr)
        return 2
    try:
        if argv[1] == "--list":
            workspace_of(argv[0])
            print("\n".join(str(rel) for _, rel in staged(argv[0])))
        elif argv[1] == "--stage":
            print(f"staged {stage(argv[0])}")
        elif (err := check(argv[0])) is not None:
            print(err, file=sys.stderr)
            return 2
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
