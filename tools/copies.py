"""Fail when a block of code is copied between modules of hfscale: pylint's copy detector (``symilar``) over them.

    python tools/copies.py [PACKAGE]     # hfscale/ by default; exit 1 when a block is found twice

A block counts when 8 or more consecutive lines, once comments and docstrings are left out, appear in two places
(imports and signatures included: eight identical lines of either are a list that belongs in one place too). Eight:
shorter runs are mostly the same dataclass fields or argparse calls, which say the same thing in two contexts
rather than hold one fact twice.

``symilar``'s options to leave out imports and signatures parse every module with astroid, whose inference walks
into torch and transformers: three minutes on 2 cores instead of half a second, so they are not used.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from pylint.checkers.symilar import Symilar

MIN_LINES = 8
ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    package = Path((argv or sys.argv[1:] or [str(ROOT / "hfscale")])[0])
    files = sorted(package.rglob("*.py"))
    detector = Symilar(min_lines=MIN_LINES, ignore_comments=True, ignore_docstrings=True)
    for path in files:
        with path.open(encoding="utf-8") as stream:
            detector.append_stream(str(path), stream)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        detector.run()
    total = re.search(r"TOTAL lines=(\d+) duplicates=(\d+)", report.getvalue())
    if total is None:
        raise SystemExit(f"tools/copies.py: symilar printed no total:\n{report.getvalue()}")
    found = int(total.group(2))
    print(report.getvalue().strip() if found else f"no block of {MIN_LINES}+ lines found twice in {len(files)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
