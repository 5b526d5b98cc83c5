"""Nothing in the repository cites a path that does not exist.

Scanned: the root's Markdown files, setup.py and every text file under docs/, fedml_ssfl/,
mobile_export/, benchmarks/ (of its results/ only the Markdown: the rest are figures), deploy/,
configs/, tests/ and .ci/ (docs,
docstrings, comments and strings alike). A citation is

* a path starting with one of the repository's folders (``docs/deploy.md``,
  ``benchmarks/round_speed.py``, ``configs/mnist5k/fedmatch.yaml``, ``tests/test_cli.py``) or with
  one of the package's (``runtime/common.py``, ``models/head.py``: read under ``fedml_ssfl/``);
  ``*`` and ``{a,b}`` expand like the shell's, and a placeholder (``{name}``, ``<name>``) stands for
  any one name;
  a name without a suffix may be an output stem (``--results benchmarks/results/x`` writes ``x.json``);
* an upper-case Markdown file named alone (``README.md``, ``CHANGELOG.md``);
* a Markdown link's target (``[text](deploy.md#anchor)``), read from the linking file's folder.

It exists when it resolves from the repository root, from ``fedml_ssfl/`` or from the citing
file's folder. A ``FILE.md#anchor`` must also name a heading of FILE (GitHub's anchor for it).
A regular expression's text (``benchmarks/round_speed\\.py``) is not a citation. Paths that a
command or a test creates are in :data:`CREATED`, each with the reason.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = (".ci", "docs", "benchmarks", "configs", "tests", "fedml_ssfl", "deploy", "mobile_export")
PACKAGE = ("runtime", "models", "algorithms", "data", "ssl")
TEXT = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ".ini", ".txt", ".csv", ".example", ""}

CREATED: dict[str, str] = {
    r"deploy/certs(/.*)?": "deploy/make_test_certs.sh writes the test certificates there",
    r"deploy/(deploy/|launch_script/)?launch_workspace(/.*)?|deploy/(launch_config|fedml-federate-packages)": (
        "deploy/build_launch.sh stages a launch job's workspace there; FedML's build writes the others"
    ),
    r"benchmarks/results/(\w+_cuda|gpu_augment_check)\.json": "written by a benchmark run on a CUDA device",
    r"benchmarks/results/ssfl_results\.json": "written by benchmarks/ssfl_results.py's sweep",
    r"configs/fedml/secret\.yaml|deploy/(job_token\.txt|no_such_script\.py|launch_script/\.env|fedml_example/data/.*)"
    r"|data/silo_0\.npz|fedml_ssfl/(\.env|runtime/id_rsa|data/silo_1\.npz)": (
        "tests/test_deploy.py writes them into a scratch clone (secrets a launch package must not carry)"
    ),
}
"""Paths a command or a test creates (full-match regex) -> which."""

_PART = r"(?:\{[^{}\s]*\}|[\w.*<>-])"
CITED = re.compile(
    rf"(?<![\w./~$-])((?:{'|'.join(map(re.escape, TOP + PACKAGE))})/(?:{_PART}|/)*(?<=[\w}}>])(?:#[\w-]+)?)"
)
BARE = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md(?:#[\w-]+)?)\b")
REGEX = ("\\", "(", "[", "|")
"""A path followed by one of these is a regular expression's text, not a citation."""
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+)\)")


def scanned_files(root: Path = ROOT) -> list[Path]:
    out = [*sorted(root.glob("*.md")), root / "setup.py"]
    for top in TOP:
        for p in sorted((root / top).rglob("*")):
            rel = p.relative_to(root).as_posix()
            skipped = "__pycache__" in rel or (rel.startswith("benchmarks/results/") and p.suffix != ".md")
            if p.is_file() and p.suffix in TEXT and not skipped:
                out.append(p)
    mine = {Path(__file__).resolve(), (ROOT / "tests" / "mutants.yaml").resolve()}  # their paths are broken on purpose
    return [p for p in out if p.exists() and p.resolve() not in mine]


def _expand(pattern: str) -> list[str]:
    """``a.{json,md}`` -> both; a placeholder ``{x}`` or ``<x>`` -> ``*`` (any one name)."""
    parts = re.split(r"(\{[^{}]*\})", re.sub(r"<[^<>]*>", "*", pattern))
    options = [(p[1:-1].split(",") if "," in p else ["*"]) if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*options)]


def anchors(md: Path) -> set[str]:
    """GitHub's anchors for ``md``'s headings (lower case, punctuation dropped, spaces to ``-``)."""
    out, seen, fenced = set(), {}, False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def resolves(cited: str, citing: Path, root: Path = ROOT) -> str | None:
    """None when ``cited`` exists (and its anchor too); else why not."""
    path, _, anchor = cited.partition("#")
    if any(re.fullmatch(p, path) for p in CREATED):
        return None
    for base in (root, root / "fedml_ssfl", citing.parent):
        per_option = [[h for h in (base.glob(p) if "*" in p else [base / p]) if h.exists()] for p in _expand(path)]
        if not all(per_option) and not Path(path).suffix:  # an output stem (--results X writes X.json, X.png)
            per_option = [list(base.glob(p + ".*")) for p in _expand(path)]
        if all(per_option):  # every alternative of a {a,b} exists
            hits = per_option[0]
            if anchor and hits[0].suffix == ".md" and anchor not in anchors(hits[0]):
                return f"{hits[0].relative_to(root).as_posix()} has no heading with the anchor #{anchor}"
            return None
    return "no such file or folder"


def broken_citations(root: Path = ROOT) -> list[str]:
    out = []
    for f in scanned_files(root):
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = f.relative_to(root).as_posix()
        for no, line in enumerate(text.splitlines(), 1):
            found = [m.group(1).rstrip(".") for m in CITED.finditer(line) if line[m.end() : m.end() + 1] not in REGEX]
            found += [m.group(1) for m in BARE.finditer(line)]
            if f.suffix == ".md":
                found += [m.group(1) for m in LINK.finditer(line)]
            for cited in dict.fromkeys(found):  # once per line
                why = resolves(cited, f, root)
                if why:
                    out.append(f"{rel}:{no}: {cited}: {why}")
    return out


def test_no_file_cites_a_path_that_does_not_exist():
    broken = broken_citations()
    assert not broken, (
        "these citations name no file of the repository; point them at a file that exists (or, for a path a "
        "command creates, add it to CREATED in tests/test_doc_paths.py with the reason):\n" + "\n".join(broken)
    )


def test_the_scan_finds_a_missing_path_a_missing_anchor_and_passes_real_ones(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x.json").write_text("{}")
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## The knobs (speed)\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "See docs/guide.md#the-knobs-speed, [it](docs/guide.md) and benchmarks/results/x.{json,md}.\n"
        "Also docs/gone.md, NOTES.md, docs/guide.md#no-such-part and [a link](docs/nowhere.md).\n"
        "A regex: `docs/gone\\.md`; a placeholder: benchmarks/results/{name}.json; deploy/certs/ca.pem.\n"
    )
    (tmp_path / "setup.py").write_text("# see docs/install.md\n")
    broken = broken_citations(tmp_path)
    assert broken == [
        "README.md:1: benchmarks/results/x.{json,md}: no such file or folder",  # x.md is missing
        "README.md:2: docs/gone.md: no such file or folder",
        "README.md:2: docs/guide.md#no-such-part: docs/guide.md has no heading with the anchor #no-such-part",
        "README.md:2: docs/nowhere.md: no such file or folder",
        "README.md:2: NOTES.md: no such file or folder",
        "setup.py:1: docs/install.md: no such file or folder",
    ]
