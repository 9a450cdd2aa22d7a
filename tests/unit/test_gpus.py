"""GPUs the plan gives a process but its framework does not see (keras_distrib/gpus.py).

The environments are what the agent gives a child: the plan file, the task and
``CUDA_VISIBLE_DEVICES`` (contract.child_env), with ``KERAS_DISTRIB_REQUIRE_GPUS`` under
--require-gpus. The device counts are injected; the real TensorFlow of this machine
(built with CUDA, no driver) is checked too.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from keras_distrib import contract
from keras_distrib.gpus import MISSING_GPUS_EXIT_CODE, check_planned_gpus, missing_gpus_line, planned_gpus

pytestmark = pytest.mark.unit


def child_env(gpus: str, require: bool = False) -> dict[str, str]:
    env = {contract.PLAN_FILE_VAR: "/tmp/plan.json", contract.TASK_VAR: "worker:0", contract.CUDA_DEVICES_VAR: gpus}
    return env | ({contract.REQUIRE_GPUS_VAR: "1"} if require else {})


@pytest.mark.parametrize("env, expected", [
    (child_env("0,1"), ["0", "1"]),
    (child_env(""), []),  # ps and chief: the plan hides every GPU
    ({contract.CUDA_DEVICES_VAR: "0,1"}, []),  # outside a job: the user's own setting, not the plan's
])
def test_the_planned_gpus_come_from_the_plan_only(env: dict[str, str], expected: list[str]) -> None:
    assert planned_gpus(env) == expected


@pytest.mark.parametrize("framework, built, cause, fix", [
    ("TensorFlow", False, "this TensorFlow has no GPU support", "pip install 'tensorflow[and-cuda]'"),
    ("JAX", False, "this JAX has no GPU support", "pip install 'jax[cuda12]'"),
    ("TensorFlow", True, "the GPU driver or CUDA libraries were not found", "run nvidia-smi on the node"),
])
def test_the_line_names_the_cause_and_the_fix(framework: str, built: bool, cause: str, fix: str) -> None:
    line = missing_gpus_line(framework, 2, 0, built)
    assert line is not None and f"gave this process 2 GPU(s) but {framework} sees 0" in line
    assert cause in line and fix in line.split("HINT: ")[1] and "--require-gpus" in line and "\n" not in line
    assert missing_gpus_line(framework, 2, 2, built) is None and missing_gpus_line(framework, 2, 3, built) is None
    assert "sees 1" in (missing_gpus_line(framework, 2, 1, built) or "")


def test_missing_gpus_warn_once_and_train_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="keras_distrib"):
        check_planned_gpus("TensorFlow", lambda: 0, lambda: False, child_env("0,1"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "TensorFlow sees 0" in caplog.records[0].getMessage()


def test_require_gpus_makes_it_an_error_with_exit_2(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="keras_distrib"), pytest.raises(SystemExit) as stop:
        check_planned_gpus("TensorFlow", lambda: 1, lambda: True, child_env("0,1", require=True))
    assert stop.value.code == MISSING_GPUS_EXIT_CODE == 2
    assert [r.levelno for r in caplog.records] == [logging.ERROR] and "sees 1" in caplog.records[0].getMessage()
    assert "stopping (--require-gpus)" in caplog.records[0].getMessage()
    assert "computes on the CPU" not in caplog.records[0].getMessage()


@pytest.mark.parametrize("env", [child_env(""), child_env("0,1", require=True)])
def test_nothing_is_counted_where_none_are_planned_or_all_are_seen(env: dict[str, str]) -> None:
    counted: list[Any] = []
    check_planned_gpus("TensorFlow", lambda: counted.append(1) or 2, lambda: True, env)
    assert counted == ([] if not planned_gpus(env) else [1])


def test_this_machines_tensorflow_sees_no_gpu_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """This machine has no GPU: a process given two says so, with the cause its build implies."""
    from keras_distrib.gpus import check_tensorflow_gpus, tensorflow_built_with_cuda

    with caplog.at_level(logging.WARNING, logger="keras_distrib"):
        check_tensorflow_gpus(child_env("0,1"))
    expected = "CUDA libraries were not found" if tensorflow_built_with_cuda() else "no GPU support"
    assert len(caplog.records) == 1 and expected in caplog.records[0].getMessage()
