"""keras_distrib's output: the standard ``logging`` module, one logger per module.

Nothing is configured at import. The entry points configure the ``keras_distrib`` logger:

* the launcher (``python -m keras_distrib...``): ``configure_launcher``. An agent's lines
  read ``[NODE agent] keras_distrib: TEXT`` (the agent passes its node in ``extra``),
  other lines ``keras_distrib: TEXT``; warnings and errors say ``warning: `` / ``error: ``
  before the text.
* inside SCRIPT and its servers (``strategy()``, ``cluster()``, ``distribution()``,
  ``fit()``, ``trainer_for()``, the servers): ``configure_script``, which adds the same
  ``keras_distrib: TEXT`` handler to the ``keras_distrib`` logger unless it has one
  (as transformers does; propagation stops, so the program's own root handlers print no
  line twice). A program that wants our records through its own handlers adds one to
  ``logging.getLogger("keras_distrib")`` first, or sets ``propagate = True`` and removes ours.

The level: ``KERAS_DISTRIB_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or a
number) if set, else ``DEBUG`` with ``--verbose``, else ``INFO``. The agent passes
``--verbose`` on to its children as ``KERAS_DISTRIB_LOG_LEVEL=DEBUG`` (contract.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from .contract import KD_LOG_LEVEL_VAR

ROOT = "keras_distrib"
PREFIX = "keras_distrib: "
#: The record attribute that names the node of an agent's line (``extra={NODE: name}``).
NODE = "agent_node"


class LineFormatter(logging.Formatter):
    """``[NODE agent] keras_distrib: error: TEXT``: the launcher's one-line style.

    ``bare``: no ``keras_distrib: `` (a server process, whose lines are all its own).
    """

    def __init__(self, bare: bool = False) -> None:
        super().__init__()
        self.bare = bare

    def format(self, record: logging.LogRecord) -> str:
        level = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}.get(record.levelno, "")
        node = getattr(record, NODE, None)
        line = f"{f'[{node} agent] ' if node else ''}{'' if self.bare else PREFIX}{level}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stderr`` of the moment (pytest's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def level_from(environ: Mapping[str, str], verbose: bool = False) -> int:
    """The level KERAS_DISTRIB_LOG_LEVEL names (an unknown value: INFO), else DEBUG/INFO by ``verbose``."""
    value = environ.get(KD_LOG_LEVEL_VAR, "").strip()
    if value:
        if value.isdigit():
            return int(value)
        named = logging.getLevelName(value.upper())
        if isinstance(named, int):
            return named
    return logging.DEBUG if verbose else logging.INFO


def _our_handler(logger: logging.Logger) -> logging.Handler | None:
    return next((h for h in logger.handlers if isinstance(h, StderrHandler)), None)


def configure_launcher(verbose: bool = False, environ: Mapping[str, str] | None = None) -> None:
    """The launcher's entry point: one stderr handler with the agent's line format."""
    logger = logging.getLogger(ROOT)
    handler = _our_handler(logger)
    if handler is None:
        handler = StderrHandler()
        handler.setFormatter(LineFormatter())
        logger.addHandler(handler)
    logger.setLevel(level_from(os.environ if environ is None else environ, verbose))
    logger.propagate = False


def configure_script(bare: bool = False) -> None:
    """Inside SCRIPT: our handler unless the ``keras_distrib`` logger has one; idempotent and cheap."""
    logger = logging.getLogger(ROOT)
    if logger.level == logging.NOTSET:  # set once; a level the program chose stays
        logger.setLevel(level_from(os.environ))
    if logger.handlers:
        return
    handler = StderrHandler()
    handler.setFormatter(LineFormatter(bare))
    logger.addHandler(handler)
    logger.propagate = False


class NodeLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A module's logger whose lines name this agent's node: ``[n1 agent] keras_distrib: ...``."""

    def __init__(self, logger: logging.Logger, node: str) -> None:
        super().__init__(logger, {NODE: node})

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**(kwargs.get("extra") or {}), **(self.extra or {})}
        return msg, kwargs
