"""``python -m mobile_export export RUN_DIR --out DIR`` | ``python -m mobile_export label MODEL INPUT --out DIR``.

``export`` is the same as ``fedml-ssfl export``; ``label`` is the edge runner (no torch needed).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m mobile_export {export,label} ...  (add -h after either for its options)"
    if not argv or argv[0] not in ("export", "label"):
        print(usage, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "label":
        from .edge_label import main as label_main

        return label_main(argv[1:])
    from .export import main as export_main

    return export_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
