"""The code blocks of the documentation (docs/**/*.md and README.md), for the tests that run them.

Every fenced block is preceded by one marker line (an HTML comment, invisible on the site):

- ``<!-- run: ID -->``: a test runs it; the test gets its text with ``docs_block("ID")``,
  and tests/unit/test_docs_blocks.py checks that some test does;
- ``<!-- same-as: ID -->``: the same text as block ID (shown twice, run once);
- ``<!-- file: PATH -->``: the whole content of the repository's file PATH, which tests use;
- ``<!-- not-run: REASON -->``: cannot run here (a real cluster command, a diagram), and why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARKER = re.compile(r"^\s*<!-- (run|same-as|file|not-run): (.+?) -->\s*$")
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)(.*)$")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    info: str  # the fence's attributes, e.g. hl_lines="4 5"
    code: str
    kind: str | None  # run, same-as, file, not-run, or None when the marker is missing
    value: str  # the block's id, the id it repeats, the file, or the reason

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """Every Markdown page of the site, plus the README."""
    found = [p for p in sorted(DOCS.rglob("*.md")) if "hooks" not in p.relative_to(DOCS).parts]
    return [REPO / "README.md", *found]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks, lang, info = match.groups()
        end = i + 1
        while end < len(lines) and not re.match(rf"^{re.escape(indent)}{ticks}\s*$", lines[end]):
            end += 1
        code = "\n".join(line[len(indent):] for line in lines[i + 1:end])
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        kind, value = marker.groups() if marker else (None, "")
        out.append(Block(path.relative_to(REPO).as_posix(), i + 1, lang, info.strip(), code + "\n", kind, value.strip()))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks_of(page)]


def docs_block(block_id: str) -> str:
    """The text of the block marked ``<!-- run: block_id -->`` (exactly one must exist)."""
    found = [b for b in all_blocks() if b.kind == "run" and b.value == block_id]
    assert len(found) == 1, f"{len(found)} blocks marked 'run: {block_id}'"
    return found[0].code


def command_lines(block_id: str) -> list[list[str]]:
    """A shell block's commands, one argv per line (comments and blank lines dropped)."""
    import shlex

    commands = []
    for line in docs_block(block_id).splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            commands.append(shlex.split(line))
    return commands
