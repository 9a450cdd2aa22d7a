"""Random bytes and random types in every parser field and config key: never a traceback.

Each example runs the command line in-process (``cli.run``, as ``python -m keras_distrib
--plan`` does) and the task-count check of a launch; the only acceptable outcomes are a
plan (exit 0) or exit 2 with one ``keras_distrib: error: ... HINT: ...`` line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from _unit_helpers import FIXTURES, fixture_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_parsers import BUILTIN_PARSERS, ClusterConfigError, ClusterParser, detect, get_parser
from cluster_parsers.tasks import LAUNCHERS
from keras_distrib.launcher import cli
from keras_distrib.launcher.options import Options
from keras_distrib.plan import build_plan, tasks_mode

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "25")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARIABLE_NAME = re.compile(r"[A-Z][A-Z0-9_]{2,}")

# A valid job for each scheduler, whose fields are then broken one at a time.
BASE_ENVS: dict[str, dict[str, str]] = {
    "slurm": fixture_env("slurm_step_task5"),
    "pbs": fixture_env("pbs_job", PBS_VNODENUM="5"),
    "sge": fixture_env("sge_mpirun_ppr1"),
    "lsf": fixture_env("lsf_jsrun_r1_a1"),
    "static": {"KERAS_DISTRIB_HOSTS_FILE": str(FIXTURES / "static_hosts.yaml")},
}
# Variables whose value names a file: their content is fuzzed too.
FILE_VARS = {"pbs": "PBS_NODEFILE", "sge": "PE_HOSTFILE", "lsf": "LSB_DJOB_HOSTFILE", "static": "KERAS_DISTRIB_HOSTS_FILE"}


def variables_read_by(parser: type[ClusterParser]) -> list[str]:
    """Every variable name a parser keeps as class data, plus the task launchers' and HOSTNAME."""
    names: set[str] = {"HOSTNAME", *(v for lv in LAUNCHERS for v in vars(lv).values() if VARIABLE_NAME.fullmatch(v))}
    for klass in parser.__mro__:
        for value in vars(klass).values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, str) and VARIABLE_NAME.fullmatch(item):
                    names.add(item)
    return sorted(names)


FIELDS = [(cls.name, var) for cls in BUILTIN_PARSERS for var in variables_read_by(cls)]

# Text as an environment can hold it (no NUL, no lone surrogate), biased towards the
# characters the parsers care about.
ENV_TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40),
    st.text(alphabet="0123456789-,[]()x :nN", max_size=30),
    st.from_regex(r"-?[0-9]{1,25}", fullmatch=True),
)
YAML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@contextlib.contextmanager
def scratch_file(content: bytes) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "input"
        path.write_bytes(content)
        yield str(path)


def run_plan(env: Mapping[str, str], *args: str, module_scheduler: str | None = None, local: bool = False) -> None:
    """``cli.run`` with ``env`` as the whole environment; assert the outcome is 0 or one HINT line."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.run(["--plan", "--format", "json", *args], module_scheduler, "keras_distrib", local=local)
    if code == 0:
        assert isinstance(json.loads(out.getvalue()), dict) and err.getvalue() == ""
        return
    assert code == 2 and out.getvalue() == ""
    if err.getvalue() == "":
        # A step-wide error is printed by task 0 only; this must be another task of a launch.
        job = detect(env).parse()
        assert job.tasks_launched and job.rank != 0, "exit 2 without a message"
        return
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, err.getvalue()
    assert lines[0].startswith("keras_distrib: error: ") and " HINT: " in lines[0], lines[0]


def check_launch(scheduler: str, env: Mapping[str, str]) -> None:
    """Parsing and the launch's task-count check raise nothing but a one-line ClusterConfigError."""
    parser = get_parser(scheduler, env)
    try:
        job = parser.parse()
        for layout in ("ps-per-node", "worker-per-gpu", "allreduce"):
            tasks_mode(job, build_plan(job, layout), parser.agent_launch_hint)
    except ClusterConfigError as exc:
        assert "\n" not in str(exc) and exc.hint


def test_every_parser_field_is_fuzzed() -> None:
    fuzzed = {var for _, var in FIELDS}
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_GPUS", "PBS_VNODENUM", "NSLOTS", "JSM_NAMESPACE_SIZE",
                "LSB_MCPU_HOSTS", "OMPI_COMM_WORLD_LOCAL_SIZE", "KERAS_DISTRIB_RANK", "SLURM_HET_SIZE"):
        assert var in fuzzed
    for name, env in BASE_ENVS.items():  # the bases are valid jobs
        run_plan(env, "--scheduler", name)
        check_launch(name, env)


@pytest.mark.parametrize(("scheduler", "var"), FIELDS)
@FUZZ
@given(value=ENV_TEXT)
def test_random_text_in_a_scheduler_variable(scheduler: str, var: str, value: str) -> None:
    env = {**BASE_ENVS[scheduler], var: value}
    check_launch(scheduler, env)
    run_plan(env, "--scheduler", scheduler)


@pytest.mark.parametrize("scheduler", sorted(FILE_VARS))
@FUZZ
@given(content=st.one_of(
    st.binary(max_size=200),
    st.lists(st.text(alphabet="ab01 \t.-_:[]#@q", max_size=20), max_size=6).map(lambda ls: "\n".join(ls).encode()),
    st.builds(yaml.safe_dump, st.dictionaries(st.sampled_from(["hosts", "gpus", "job_id", "tasks_per_node", "x"]),
                                              YAML_VALUES, max_size=4)).map(str.encode),
))
def test_random_host_files(scheduler: str, content: bytes) -> None:
    with scratch_file(content) as path:
        env = {**BASE_ENVS[scheduler], FILE_VARS[scheduler]: path}
        check_launch(scheduler, env)
        run_plan(env, "--scheduler", scheduler)


CONFIG_KEYS = [*Options.keys(), *(k.replace("-", "_") for k in Options.keys() if "-" in k)]


@pytest.mark.parametrize("key", CONFIG_KEYS)
@FUZZ
@given(value=YAML_VALUES)
def test_random_types_for_every_config_key(key: str, value: Any) -> None:
    with scratch_file(yaml.safe_dump({key: value}).encode()) as path:
        run_plan(BASE_ENVS["slurm"], "--config", path)
        run_plan({}, "--config", path, local=True)


@FUZZ
@given(content=st.one_of(st.binary(max_size=300), st.builds(yaml.safe_dump, YAML_VALUES).map(str.encode)))
def test_random_config_files(content: bytes) -> None:
    with scratch_file(content) as path:
        run_plan(BASE_ENVS["slurm"], "--config", path)


@FUZZ
@given(value=ENV_TEXT)
def test_random_port_base_and_scheduler_variables(value: str) -> None:
    run_plan({**BASE_ENVS["slurm"], "KERAS_DISTRIB_PORT_BASE": value})
    run_plan({**BASE_ENVS["pbs"], "KERAS_DISTRIB_SCHEDULER": value})
