"""A model's own train_step / test_step / predict_step run in every layout (issue 29).

One Keras user script (tests/local/custom_steps_script.py: Keras' guide "Customizing what
happens in fit()" transcribed) runs unchanged under plain single-process ``model.fit`` (no
launcher: keras_distrib.fit is model.fit there) and under keras_distrib on 2 workers
in ``ps-per-node`` and 3 in ``allreduce``, and on one all-reduce worker with 2 replicas (one
input pipeline dealing batches to two replicas, as on a node with 2 GPUs).

Tolerance against the single-process run: the models are a linear regression that
converges to its noise floor (MSE about 0.0025) within the 8 epochs; the last epoch's loss
and mae must be within 0.01 / 0.02 of the single-process run's (asynchronous workers and
per-worker shards change the path, not the end point). The user's code is proven to run:
step counters (tf.Variables its steps increment), a constant 100 / 1000 its steps add to
the reported loss, a second output of its predict_step, and two optimizers' step counts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any

import pytest

from trainer_cluster import REPO, last_json_line, run_script_cluster

sys.path.insert(0, str(REPO / "tests"))
from docs_blocks import docs_block  # noqa: E402

pytestmark = pytest.mark.local

SCRIPT = REPO / "tests" / "local" / "custom_steps_script.py"
N, VAL, BATCH, EPOCHS, GAN_EPOCHS = 203, 61, 16, 8, 3


def shard_sizes(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def steps_per_epoch(layout: str, workers: int, n: int, replicas_per_worker: int = 1) -> int:
    """Steps of one epoch: ps, every worker's shard in batches of 16; all-reduce, the global
    batch 16 split over the replicas, the longest shard deciding (own_step_batches)."""
    if layout == "single":
        return math.ceil(n / BATCH)
    if layout == "ps-per-node":
        return sum(math.ceil(s / BATCH) for s in shard_sizes(n, workers))
    per_replica = BATCH // (workers * replicas_per_worker)
    return max(math.ceil(math.ceil(s / per_replica) / replicas_per_worker) for s in shard_sizes(n, workers))


def run_single(env: dict[str, str] | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2",
           **(env or {})}
    for key in ("TF_CONFIG", "KERAS_DISTRIB_LAYOUT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json_line(proc.stdout)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The script under plain single-process Keras."""
    return run_single()


def check(result: dict[str, Any], ref: dict[str, Any], layout: str, workers: int, replicas: int = 1) -> None:
    train_steps = steps_per_epoch(layout, workers, N, replicas)
    val_steps = steps_per_epoch(layout, workers, VAL, replicas)

    first = result["first"]
    assert first["calls"] == first["iterations"] == EPOCHS * train_steps  # the user's step ran, every step
    assert first["weight_calls"] == first["calls"]  # a Keras weight's increments, none lost between workers
    for key, tol in (("loss", 0.01), ("mae", 0.02)):
        assert abs(first["history"][key][-1] - ref["first"]["history"][key][-1]) < tol, (key, first, ref["first"])
    assert first["history"]["loss"][-1] < first["history"]["loss"][0] / 10  # it trained

    assert result["first_steps_per_epoch"] == {"calls": 10, "epochs": 2}
    # The step's own loss (+100) beside compile_metrics, which hold a "loss" too: History has
    # the step's, as plain Keras has (it used to show the compiled loss tracker's, about 1).
    for own_loss in (result["own_loss"]["history"], ref["own_loss"]["history"]):
        assert set(own_loss) == {"loss", "mae"} and all(100.0 <= v < 200.0 for v in own_loss["loss"]), own_loss
        assert all(0.0 < v < 10.0 for v in own_loss["mae"]), own_loss

    lower = result["lower"]["history"]  # own trackers, no compiled loss, +100 in the reported loss
    assert all(v >= 100.0 for v in lower["loss"]), lower
    assert abs(lower["loss"][-1] - ref["lower"]["history"]["loss"][-1]) < 0.01
    assert abs(lower["mae"][-1] - ref["lower"]["history"]["mae"][-1]) < 0.02

    weighted = result["weighted"]["history"]
    assert abs(weighted["loss"][-1] - ref["weighted"]["history"]["loss"][-1]) < 0.01, (weighted, ref["weighted"])

    own = result["own_test"]  # the user's test_step: validation and evaluate
    assert all(v >= 1000.0 for v in own["history"]["val_loss"]) and len(own["history"]["val_loss"]) == EPOCHS
    assert all(v < 1000.0 for v in own["history"]["loss"])  # training used the default train_step
    loss, mae = own["evaluate"]  # Keras' return shape: [loss, mae] in metrics_names order
    assert set(own["evaluate_dict"]) == {"loss", "mae"}
    assert loss >= 1000.0 and abs(loss - own["evaluate_dict"]["loss"]) < 1e-3  # float32 near 1000: ulp 6e-5
    assert abs(mae - own["evaluate_dict"]["mae"]) < 1e-4  # every worker's updates counted both times
    assert abs(mae - ref["own_test"]["evaluate"][1]) < 0.02
    assert own["test_calls"] == EPOCHS * val_steps + 2 * steps_per_epoch(layout, workers, N, replicas)
    for n, got in own["exact"].items():  # uneven shards: split batches, every example once
        assert got["steps"] == steps_per_epoch(layout, workers, int(n), replicas), (n, got)
        assert abs(got["mae"] - got["local_mae"]) < 1e-5, (n, got)

    pred = result["own_predict"]  # the user's predict_step: its extra output, rows in input order
    assert pred["twice"] == pytest.approx([2 * v for v in pred["x0"]], abs=1e-6)
    assert pred["y"] == pytest.approx(ref["own_predict"]["y"], abs=0.1)

    gan = result["gan"]  # two optimizers, one step each per train_step
    assert gan["d_iterations"] == gan["g_iterations"] == GAN_EPOCHS * train_steps
    assert all(math.isfinite(v) for vs in gan["history"].values() for v in vs)
    assert set(gan["history"]) == {"d_loss", "g_loss"}

    refusals = result["refusals"]
    if layout == "ps-per-node":
        for option in ("ps_local_steps", "ps_stale_reads"):
            assert "overrides train_step" in refusals[option] and f"{option}=True" in refusals[option]
            assert "HINT: drop " + option in refusals[option] and "\n" not in refusals[option]
    assert "jit_compile=True" in refusals["jit_compile"] and "HINT:" in refusals["jit_compile"]
    assert "run_eagerly=True" in refusals["run_eagerly"] and "HINT:" in refusals["run_eagerly"]
    assert refusals["compiled_steps_per_execution"] == 4  # model.compile(steps_per_execution=4) honoured


def test_reference_is_plain_keras(reference: dict[str, Any]) -> None:
    """The single-process run is Keras' own loop (the numbers every layout is held to)."""
    assert reference["first"]["calls"] == EPOCHS * steps_per_epoch("single", 1, N)
    assert reference["first"]["history"]["loss"][-1] < 0.005
    assert "refusals" not in reference


# 2 workers in one layout and 3 in the other (both shard 203 unevenly), and one worker with 2
# replicas below: each layout and worker count once (all four ran 96 s more in CI).
#: One trainer per run (2-4 minutes each on 2 cores), in turn (tests/conftest.py); one
#: all-reduce worker with two replicas runs the steps below in every run.
@pytest.mark.rotating(2)
@pytest.mark.parametrize("layout,workers", [("ps-per-node", 2), ("allreduce", 3)])
def test_own_steps_run_in_every_layout(reference: dict[str, Any], layout: str, workers: int) -> None:
    procs = run_script_cluster(SCRIPT, [], num_workers=workers, num_ps=1 if layout != "allreduce" else 0,
                               layout=layout, timeout=900)
    for p in procs:
        assert p.returncode == 0, p.stderr[-4000:]
    results = [last_json_line(p.stdout) for p in procs]
    if layout == "allreduce":  # lockstep: every worker reports the same
        assert all(r["first"] == results[0]["first"] for r in results)
    check(results[0], reference, layout, workers)


def test_own_steps_on_one_worker_with_two_replicas(reference: dict[str, Any]) -> None:
    """One pipeline, two replicas: every step gives both a real batch (11 examples -> 4+4, 2+1...)."""
    result = run_single({"CUSTOM_STEPS_LOCAL_REPLICAS": "2"})
    check(result, reference, "allreduce", 1, replicas=2)


def test_the_docs_example_runs_on_two_workers(tmp_path: Any) -> None:
    """docs/keras-contract.md's example, as written, on 2 all-reduce workers."""
    script = tmp_path / "custom_train_step.py"
    script.write_text(docs_block("custom-train-step"))
    procs = run_script_cluster(script, [], num_workers=2, layout="allreduce", timeout=600)
    for p in procs:
        assert p.returncode == 0, p.stderr[-4000:]
        history = eval(p.stdout.strip().splitlines()[-1])  # the block prints history.history
        assert set(history) == {"loss", "mae"} and len(history["loss"]) == 2
