"""ARCHITECTURE.md's table "Files over ~400 lines, and why" stays true: every file it lists
exists with about the line count it gives (within 10 %), and every module of the package
over 500 lines is listed with its reason (issue 40: the table cannot go stale)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenserve"
HEADING = "## Files over ~400 lines, and why"
#: how far a file may drift from the table's figure, as a fraction of the figure
TOLERANCE = 0.10
#: a module longer than this must have a row
MUST_LIST = 500


def table_rows(text: str) -> list[tuple[str, int]]:
    """(path relative to the checkout, listed lines) for every file of the table.

    A row's first cell names one or more files in backticks, relative to ``tokenserve/``
    unless they start with ``tokenserve/``; a bare file name is in the previous one's
    folder. Its second cell gives their sizes in the same order (``~640, ~490``).
    """
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        sizes = [int(n) for n in re.findall(r"~(\d+)", cells[1])]
        assert len(names) == len(sizes), f"row names {names} but gives sizes {sizes}"
        folder = ""
        for name, size in zip(names, sizes, strict=True):
            if "/" not in name:
                name = f"{folder}/{name}"
            elif not name.startswith("tokenserve/"):
                name = f"tokenserve/{name}"
            folder = name.rsplit("/", 1)[0]
            rows.append((name, size))
    return rows


def line_count(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def test_the_table_parses() -> None:
    rows = dict(table_rows((ROOT / "ARCHITECTURE.md").read_text()))
    assert rows["tokenserve/engine/scheduler.py"] > 0
    sample = ("## Files over ~400 lines, and why\n\n| file | lines | why |\n|---|---|---|\n"
              "| `a/b.py` | ~100 | x |\n| `tokenserve/c/d.py`, `e.py` | ~200, ~300 | y |\n\n"
              "## Next\n| `f.py` | ~1 | z |\n")
    assert table_rows(sample) == [("tokenserve/a/b.py", 100), ("tokenserve/c/d.py", 200),
                                  ("tokenserve/c/e.py", 300)]


def test_listed_files_have_the_listed_size() -> None:
    wrong = []
    for name, listed in table_rows((ROOT / "ARCHITECTURE.md").read_text()):
        path = ROOT / name
        if not path.is_file():
            wrong.append(f"{name}: listed, but there is no such file")
            continue
        n = line_count(path)
        if abs(n - listed) > TOLERANCE * listed:
            wrong.append(f"{name}: {n} lines, the table says ~{listed}")
    assert not wrong, "ARCHITECTURE.md 'Files over ~400 lines' is stale:\n" + "\n".join(wrong)


def test_every_module_over_500_lines_is_listed() -> None:
    listed = {name for name, _ in table_rows((ROOT / "ARCHITECTURE.md").read_text())}
    missing = [f"{p.relative_to(ROOT)}: {line_count(p)} lines"
               for p in sorted(PACKAGE.rglob("*.py"))
               if line_count(p) > MUST_LIST and str(p.relative_to(ROOT)) not in listed]
    assert not missing, ("add a row (and why it stays whole) to ARCHITECTURE.md 'Files over "
                         "~400 lines':\n" + "\n".join(missing))
