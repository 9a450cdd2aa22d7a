"""keras_distrib.once where no process waits (no TensorFlow started): outside a job, the
parameter-server chief, a one-worker job; and its argument checks."""

from __future__ import annotations

import json

import pytest

from keras_distrib import coordination as once_module
from keras_distrib.coordination import once

pytestmark = pytest.mark.unit


def tf_config(monkeypatch: pytest.MonkeyPatch, cluster: dict[str, list[str]], job: str, index: int) -> None:
    for var in ("KERAS_DISTRIB_PLAN_FILE", "KERAS_DISTRIB_TASK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": job, "index": index}}))


def test_outside_a_job_fn_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KERAS_DISTRIB_PLAN_FILE", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    assert once(lambda: 7) == 7


def test_ps_layout_chief_runs_fn_and_per_node_says_what_it_cannot_reach(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    tf_config(monkeypatch, {"chief": ["n1:1"], "ps": ["n1:2", "n2:2"], "worker": ["n1:3", "n2:3"]}, "chief", 0)
    calls = []
    assert once(lambda: calls.append(1) or "done") == "done"
    assert capsys.readouterr().err == ""
    assert once(lambda: calls.append(2), per_node=True, name="copy") is None
    assert calls == [1, 2]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("keras_distrib: warning: keras_distrib.once(copy, per_node=True): "
                                               "in layout ps-per-node only the chief runs SCRIPT"), err
    assert "HINT: " in err[0]


def test_a_single_worker_runs_fn_without_a_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    tf_config(monkeypatch, {"worker": ["n1:3"]}, "worker", 0)
    monkeypatch.setattr(once_module, "_store", lambda layout: pytest.fail("no process waits: no store needed"))
    assert once(lambda: 3) == 3


@pytest.mark.parametrize("fn,kw,expected", [
    (5, {}, "fn=5 is not callable. HINT: "),
    (lambda: 1, {"timeout": 0}, "timeout=0 must be a positive number of seconds. HINT: "),
    (lambda: 1, {"timeout": -3.0}, "timeout=-3.0 must be a positive"),
])
def test_bad_arguments_are_refused_with_a_hint(fn: object, kw: dict[str, object], expected: str) -> None:
    with pytest.raises((TypeError, ValueError), match=expected.replace("(", r"\(").replace(")", r"\)")):
        once(fn, **kw)  # type: ignore[arg-type]
