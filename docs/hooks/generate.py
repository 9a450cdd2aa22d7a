"""MkDocs hook: fills ``<!-- gen: NAME -->`` markers with tables generated from the code.

Names: ``cli-options``, ``config-keys``, ``contract`` (docs/hooks/reference.py) and
``errors`` (docs/hooks/errors.py). An unknown name fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import errors  # noqa: E402
import reference  # noqa: E402

MARKER = re.compile(r"<!-- gen: ([\w-]+) -->")
GENERATORS = {**reference.GENERATORS, "errors": errors.markdown}


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated text."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()
    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)
