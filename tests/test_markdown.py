"""The project's Markdown reads as written: every table row has its header's cells, and every relative link
names a file that exists (README, docs, patches, benchmarks' results)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted(
    [ROOT / "README.md"]
    + [p for d in ("docs", "patches", "tools", "benchmarks") for p in (ROOT / d).rglob("*.md")]
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def cells(row: str) -> list[str]:
    """A table row's cells: split at `|` outside code spans, `\\|` kept as text."""
    out, cur, code, i = [], "", False, 0
    while i < len(row):
        c = row[i]
        if c == "\\" and i + 1 < len(row):
            cur, i = cur + row[i : i + 2], i + 2
            continue
        code ^= c == "`"
        if c == "|" and not code:
            out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    return out[1:] + ([cur] if cur.strip() else [])


def test_cells():
    assert cells("| a | `b | c` | d \\| e |") == [" a ", " `b | c` ", " d \\| e "]
    assert cells("| a | b") == [" a ", " b"]


def test_files_are_found():
    assert ROOT / "README.md" in FILES and ROOT / "benchmarks" / "results" / "README.md" in FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_and_links(path):
    lines = path.read_text().split("\n")
    width, wrong = None, []
    for n, line in enumerate(lines, 1):
        if not line.startswith("|"):
            width = None
            continue
        got = len(cells(line.rstrip()))
        if width is None:
            width = got
        elif got != width:
            wrong.append(f"line {n}: {got} cells, the header has {width}")
    missing = [
        f"line {n}: {m.group(1)}"
        for n, line in enumerate(lines, 1)
        for m in LINK.finditer(line)
        if "://" not in m.group(1) and not m.group(1).startswith("mailto:")
        and not (path.parent / m.group(1)).exists()
    ]
    assert not wrong and not missing, (wrong, missing)
