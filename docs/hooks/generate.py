"""MkDocs hook: fills ``<!-- gen: NAME -->`` markers with tables generated from the code.

Names: ``cli-options``, ``config-keys``, ``contract``, ``schedulers``, ``public-api`` (docs/hooks/reference.py) and
``errors`` (docs/hooks/errors.py). An unknown name fails the build.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load(name: str) -> ModuleType:
    """A sibling file as a module of a unique name (hooks are not a package on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"keras_distrib_docs_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


errors = load("errors")
reference = load("reference")

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
