"""Every benchmark program runs once in its tiny --smoke configuration (issue #5: they
cannot rot). Asserts that each one works and writes its results; never asserts a speed."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_utils import run_in_session

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
# report.py formats the others' results rather than measuring, and accuracy_parity.py is a
# job SCRIPT (run under the launcher): each is tested on its own below. elastic.py needs the
# real Slurm test cluster, which tests/slurm holds for the session: tests/slurm/test_elastic_slurm.py
# runs its jobs, and test_elastic_bench_reads_the_membership_phases below its parsing. chaos.py
# too: tests/slurm/test_chaos_slurm.py runs a short schedule per layout on that cluster.
PROGRAMS = sorted(p.stem for p in BENCH.glob("*.py")
                  if not p.name.startswith("_") and p.stem not in ("report", "accuracy_parity", "elastic", "chaos"))
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# Smoke runs that train another model than the default mlp (which the other training
# benchmarks' smoke runs train), run from the repository root. ps_throughput: a model given
# by a path relative to the caller's directory (how a model that is not built in gets
# benchmarked: the training job runs elsewhere), with BatchNorm and dropout through the
# trainer's packed step.
SMOKE_MODELS = {"ps_throughput": ("bench/models/extra_models.py:bn_cnn", "1. PS throughput bn_cnn")}


def test_every_issue_benchmark_is_here() -> None:
    assert {"ps_throughput", "sync_throughput", "launch_overhead", "shutdown_latency",
            "plan_scaling", "input_stall"} <= set(PROGRAMS)


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def bench_env() -> dict[str, str]:
    """This environment without scheduler variables, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "KERAS_DISTRIB_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


#: A third of the programs per run (each 0.1-2.5 minutes), in turn (tests/conftest.py).
@pytest.mark.rotating(3)
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p != "jax_ps_throughput"])  # with --accuracy below
def test_smoke(program: str, tmp_path: Path) -> None:
    model, row = SMOKE_MODELS.get(program, (None, None))
    extra = ["--models", model] if model else []
    proc = run_in_session([sys.executable, str(BENCH / f"{program}.py"), "--smoke", "--out", str(tmp_path), *extra],
                          300, cwd=REPO if model else tmp_path, env=bench_env())
    assert proc.returncode == 0, f"{program} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "A/B median" in proc.stdout, proc.stdout  # the printed table

    data = json.loads((tmp_path / f"{program}.json").read_text())
    assert data["benchmark"] == program
    assert data["comparisons"], "no comparison saved"
    if row:
        assert row in [c["name"] for c in data["comparisons"]]
    for c in data["comparisons"]:
        assert c["a"] and len(c["a"]) == len(c["b"]), c
        numbers = c["a"] + c["b"] + [v for k, v in c["summary"].items()]
        assert all(_positive_finite(v) for v in numbers), f"{c['name']}: {numbers}"
    if HAVE_MATPLOTLIB:
        assert (tmp_path / f"{program}.png").stat().st_size > 0
    if program == "straggler":
        # The dynamic hand-out of a tf.data input: the worker at a fifth of its speed ran fewer
        # parts of each epoch (fixed shards give every worker exactly half; about 0.2-0.3 here).
        assert data["slow_worker_share"]["tfdata-2"][0] < 0.45, data["slow_worker_share"]


def test_report_formats_measured_results(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, str(BENCH / "plan_scaling.py"), "--smoke", "--out", str(tmp_path)],
                   env=env, capture_output=True, text=True, timeout=120, check=True)
    measured = json.loads((tmp_path / "plan_scaling.json").read_text())["comparisons"][0]["summary"]["ratio_median"]
    out = subprocess.run([sys.executable, str(BENCH / "report.py"), "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"| {measured:.3f} |" in out
    assert "| ps_throughput | not run |" in out



def test_accuracy_parity_runs_as_a_job_script(tmp_path: Path) -> None:
    """The smallest accuracy-parity run: one model class with two named inputs, one epoch, one
    seed; also in the opt-in ps_local_steps mode (the program's loop over the opt-in modes; dict
    inputs through both modes' steps are trained in tests/local/test_lookup_layers.py)."""
    proc = run_in_session([sys.executable, "-m", "keras_distrib.local", "--nodes", "2", str(BENCH / "accuracy_parity.py"),
                           "--models", "two_inputs", "--epochs", "1", "--seeds", "1", "--ps-local-steps"],
                          600, cwd=tmp_path, env=bench_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines() if '] {"model"' in line]
    assert [r["model"] for r in rows] == ["two_inputs"], proc.stdout[-3000:]
    assert 0.0 <= rows[0]["single"][0] <= 1.0 and 0.0 <= rows[0]["distributed"][0] <= 1.0
    assert "stale_reads" not in rows[0] and 0.0 <= rows[0]["local_steps"][0] <= 1.0


def test_accuracy_parity_embedding_allreduce_three_workers(tmp_path: Path) -> None:
    """Sparse (embedding) gradients in all-reduce over 3 workers: TensorFlow's IndexedSlices
    all-gather failed with "Shape mismatch in the collective instance"; they go dense now."""
    proc = run_in_session([sys.executable, "-m", "keras_distrib.local", "--nodes", "3", "--layout", "allreduce",
                           str(BENCH / "accuracy_parity.py"), "--models", "embedding", "--epochs", "1", "--seeds", "1"],
                          600, cwd=tmp_path, env=bench_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines() if '] {"model"' in line]
    assert [(r["model"], r["workers"]) for r in rows] == [("embedding", 3)], proc.stdout[-3000:]


def test_elastic_bench_reads_the_membership_phases() -> None:
    sys.path.insert(0, str(BENCH))
    from elastic import phases_of

    epoch = "[n1 chief:0] keras_distrib: epoch {}/20: 0.9 s, {} steps/s (worker 0: 1, worker 1: 1 steps/s)"
    text = "\n".join([
        epoch.format(1, 10), epoch.format(2, 200), epoch.format(3, 220),
        "[n1 agent] keras_distrib: warning: lost n3; continuing on 2 nodes (n1, n2) from the checkpoint at epoch 3, step 600",
        epoch.format(3, 50), epoch.format(4, 150),
        "[n1 agent] keras_distrib: warning: n3 rejoined; continuing on 3 nodes (n1, n2, n3) from the checkpoint at epoch 4",
        epoch.format(5, 40), epoch.format(6, 230), epoch.format(7, 210),
    ])
    assert phases_of(text) == {"3 nodes": [200.0, 220.0], "2 nodes": [150.0], "rejoined": [230.0, 210.0]}


def test_jax_ps_throughput_smoke_with_accuracy(tmp_path: Path) -> None:
    """bench/jax_ps_throughput.py's --smoke run with its accuracy rows (test_smoke runs it without):
    the JAX ps job, the TensorFlow ps job, one JAX and one TensorFlow process each exit 0, and every row, the
    accuracy too, is saved with positive, finite figures."""
    proc = run_in_session([sys.executable, str(BENCH / "jax_ps_throughput.py"), "--smoke", "--accuracy",
                           "--out", str(tmp_path)], 300, cwd=tmp_path, env=bench_env())
    assert proc.returncode == 0, f"jax_ps_throughput failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "A/B median" in proc.stdout, proc.stdout

    data = json.loads((tmp_path / "jax_ps_throughput.json").read_text())
    assert data["benchmark"] == "jax_ps_throughput"
    names = [c["name"] for c in data["comparisons"]]
    assert [n.split(" mlp")[0] for n in names] == ["JAX ps vs TF ps trainer", "JAX ps vs one JAX process (distribution cost)",
                                                   "one JAX process vs one TF process (the backends' own kernels)",
                                                   "accuracy"], names
    for c in data["comparisons"]:
        assert c["a"] and len(c["a"]) == len(c["b"]), c
        numbers = c["a"] + c["b"] + [v for k, v in c["summary"].items()]
        assert all(_positive_finite(v) for v in numbers), f"{c['name']}: {numbers}"
    accuracies = data["comparisons"][-1]["a"] + data["comparisons"][-1]["b"]
    assert all(0.0 < a <= 1.0 for a in accuracies), accuracies
    points = data["accuracy_points"]["mlp"]
    assert len(points) == 1 and math.isfinite(points[0]), points
