"""keras_distrib's output goes through ``logging``: one format, levels, nothing set up at import."""

from __future__ import annotations

import ast
import io
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from keras_distrib import logs

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "keras_distrib"
# Output that IS the product: the --plan table/JSON, the cluster check's report.
PRINTS_ALLOWED = {"launcher/cli.py", "check.py", "jax_check.py", "check_table.py"}


@pytest.fixture()
def restore_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger(logs.ROOT)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def record(level: int, text: str, **extra: str) -> logging.LogRecord:
    rec = logging.LogRecord("keras_distrib.launcher.agent", level, __file__, 1, text, (), None)
    rec.__dict__.update(extra)
    return rec


def test_the_agents_line_format() -> None:
    fmt = logs.LineFormatter()
    assert fmt.format(record(logging.INFO, "got SIGTERM", **{logs.NODE: "n1"})) == "[n1 agent] keras_distrib: got SIGTERM"
    assert fmt.format(record(logging.ERROR, "x; stopping the job.", **{logs.NODE: "n2"})) == (
        "[n2 agent] keras_distrib: error: x; stopping the job.")
    assert fmt.format(record(logging.WARNING, "--no-isolation: ...")) == "keras_distrib: warning: --no-isolation: ..."
    assert logs.LineFormatter(bare=True).format(record(logging.INFO, "serving ps:0")) == "serving ps:0"


@pytest.mark.parametrize(("value", "verbose", "level"), [
    ("", False, logging.INFO), ("", True, logging.DEBUG), ("warning", False, logging.WARNING),
    ("ERROR", True, logging.ERROR), ("15", False, 15), ("loud", False, logging.INFO), ("loud", True, logging.DEBUG),
])
def test_level_from_the_variable_then_verbose(value: str, verbose: bool, level: int) -> None:
    assert logs.level_from({"KERAS_DISTRIB_LOG_LEVEL": value} if value else {}, verbose) == level


def test_launcher_logging_is_one_handler_on_the_stderr_of_the_moment(restore_logger: logging.Logger) -> None:
    logs.configure_launcher(False, {})
    logs.configure_launcher(False, {"KERAS_DISTRIB_LOG_LEVEL": "WARNING"})  # again: still one handler
    assert len([h for h in restore_logger.handlers if isinstance(h, logs.StderrHandler)]) == 1
    err = io.StringIO()
    node_log = logs.NodeLogger(logging.getLogger("keras_distrib.launcher.agent"), "n1")
    with redirect_stderr(err):
        node_log.info("hidden at WARNING")
        node_log.warning("shown")
    assert err.getvalue() == "[n1 agent] keras_distrib: warning: shown\n"
    logs.configure_launcher(True, {})
    with redirect_stderr(err):
        node_log.debug("state RUNNING -> STOPPED")
    assert err.getvalue().endswith("[n1 agent] keras_distrib: state RUNNING -> STOPPED\n")


def test_script_logging_keeps_a_handler_the_program_added(restore_logger: logging.Logger) -> None:
    restore_logger.handlers[:] = []
    mine = logging.NullHandler()
    restore_logger.addHandler(mine)
    logs.configure_script()
    assert restore_logger.handlers == [mine]


def test_importing_keras_distrib_configures_no_logging() -> None:
    code = (
        "import logging, pkgutil, importlib, keras_distrib\n"
        "for m in pkgutil.walk_packages(keras_distrib.__path__, 'keras_distrib.'):\n"
        "    if m.name.split('.')[-1] not in ('__main__', 'local', 'slurm', 'pbs', 'sge', 'lsf', 'check', 'jax_check') "
        "and 'jax_distribution' not in m.name and 'trainers' not in m.name and 'data' not in m.name:\n"
        "        importlib.import_module(m.name)\n"
        "assert not logging.getLogger('keras_distrib').handlers and not logging.getLogger().handlers\n"
        "assert logging.getLogger('keras_distrib').level == logging.NOTSET\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_module_prints_outside_the_product_output() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name in PRINTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{name}:{node.lineno}")
    assert not found, "use a module logger (logging.getLogger(__name__)): " + ", ".join(found)


def test_modules_run_with_dash_m_log_under_our_logger() -> None:
    """Run as ``python -m``, a module's ``__name__`` is ``__main__``: ``getLogger(__name__)``
    there is outside the ``keras_distrib`` tree, and its INFO lines vanish (the servers'
    "serving ps:0 at ..." line did)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if '__name__ == "__main__"' in text and "getLogger(__name__)" in text:
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []

