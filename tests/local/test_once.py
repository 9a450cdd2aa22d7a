"""``keras_distrib.once``: data preparation on one process while the others wait (issue 30).

One local-mode job of 3 emulated nodes in the all-reduce layout (every worker runs SCRIPT)
runs every case in one script: the example of docs/porting.md as written; a job-wide preparation that writes TFRecord files slowly
(a race would show as a second writer or a short read), then every worker reads them; a
per-node preparation (each emulated node its own directory); the return value; a waiter's
timeout; a failure caught on every process. A second job lets the failure end it, as in a
script that does not catch it. A third runs two processes of the jax layout.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from docs_blocks import docs_block
from launcher_utils import meaningful, start_local

pytestmark = pytest.mark.local

SCRIPT = r'''
import json, os, sys, time
import keras_distrib
from keras_distrib import OnceError

out = sys.argv[1]
task = os.environ["KERAS_DISTRIB_TASK"]
node = os.environ["KERAS_DISTRIB_NODE"]
N = 300
result = {"task": task, "node": node}


def record(what):
    with open(os.path.join(out, "ran.log"), "a") as fh:
        fh.write(f"{what} {task} {node}\n")


def prepare(directory):
    def run():
        import tensorflow as tf
        record(f"prepare:{directory}")
        os.makedirs(directory, exist_ok=True)
        for shard in range(3):
            with tf.io.TFRecordWriter(os.path.join(directory, f"part-{shard}.tfrecord")) as w:
                for i in range(shard, N, 3):
                    w.write(tf.train.Example(features=tf.train.Features(feature={
                        "i": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))})).SerializeToString())
                    if i == 150:
                        time.sleep(2)  # a reader that did not wait would find a short or corrupt file
        return "written"
    return run


def read(directory):
    import tensorflow as tf
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory))
    spec = {"i": tf.io.FixedLenFeature([], tf.int64)}
    ids = [int(tf.io.parse_single_example(r, spec)["i"]) for r in tf.data.TFRecordDataset(files)]
    return sorted(ids) == list(range(N))


if sys.argv[2] == "fail":
    keras_distrib.once(lambda: 1 / 0, name="divide")
    sys.exit(0)

# The docs' example (docs/porting.md, "Preparing data once") first, as written.
import runpy
result["docs_records"] = runpy.run_path(os.path.join(out, "docs_example.py"))["records"]
shared = os.path.join(out, "shared")
result["returned"] = keras_distrib.once(prepare(shared), name="prepare")
result["shared_ok"] = read(shared)
local = os.path.join(out, "nodes", node)  # stands for a node-local disk
keras_distrib.once(prepare(local), per_node=True)
result["node_ok"] = read(local)
try:
    keras_distrib.once(lambda: time.sleep(8), timeout=1.5, name="slow")
    result["slow"] = "finished"
except OnceError as exc:
    result["slow"] = str(exc)
try:
    keras_distrib.once(lambda: int("not a number"), name="parse")
    result["failed"] = "no error"
except OnceError as exc:
    result["failed"] = "OnceError: " + str(exc)
except ValueError as exc:
    result["failed"] = "ValueError: " + str(exc)
keras_distrib.once(lambda: record("after"), name="after")  # the calls stay paired after errors
with open(os.path.join(out, f"result-{task}.json"), "w") as fh:  # workers other than 0 are quiet
    json.dump(result, fh)
'''


def port_base() -> int:
    """A block of 20 ports that are free now (the launcher's port block)."""
    for _ in range(50):
        base = random.randrange(25000, 29000, 20)
        socks = []
        try:
            for port in range(base, base + 20):
                s = socket.socket()
                socks.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of 20 ports")


def run_job(tmp_path: Path, mode: str) -> tuple[int, str]:
    (tmp_path / "once_script.py").write_text(SCRIPT)
    (tmp_path / "docs_example.py").write_text(docs_block("prepare-once"))
    proc = start_local(["--nodes", "3", "--layout", "allreduce", "--port-base", str(port_base()),
                        "--max-restarts", "0", "once_script.py", str(tmp_path), mode], tmp_path)
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def test_once_runs_on_one_process_per_job_or_node_and_the_others_wait(tmp_path: Path) -> None:
    code, out = run_job(tmp_path, "cases")
    assert code == 0, out[-6000:]
    results = {}
    for path in tmp_path.glob("result-*.json"):
        r = json.loads(path.read_text())
        results[r["task"]] = r
    assert sorted(results) == ["worker:0", "worker:1", "worker:2"], out[-6000:]
    ran = (tmp_path / "ran.log").read_text().splitlines()
    shared = [line for line in ran if line.startswith(f"prepare:{tmp_path / 'shared'} ")]
    assert [line.split()[1] for line in shared] == ["worker:0"], ran  # once, by the first worker
    per_node = sorted(line.split()[2] for line in ran if "/nodes/" in line.split()[0])
    assert per_node == sorted(r["node"] for r in results.values()) and len(set(per_node)) == 3, ran
    assert [line.split()[1] for line in ran if line.startswith("after ")] == ["worker:0"], ran
    assert "[local0 worker:0] 1797 records in 4 files" in out, out[-6000:]  # the docs example's line
    assert sorted(p.name for p in (tmp_path / "data" / "digits").iterdir()) == [f"part-{i}.tfrecord" for i in range(4)]
    for task, r in results.items():
        leader = task == "worker:0"
        assert r["docs_records"] == 1797, r
        assert r["shared_ok"] and r["node_ok"], r  # every record there when the wait ended
        assert r["returned"] == ("written" if leader else None), r
        if leader:
            assert r["slow"] == "finished" and r["failed"] == "ValueError: invalid literal for int() with base 10: 'not a number'", r
        else:
            assert "waited timeout=1.5 s for worker:0" in r["slow"] and "HINT: " in r["slow"], r
            assert r["failed"].startswith("OnceError: keras_distrib.once(parse) failed on worker:0 on "), r
            assert "ValueError: invalid literal for int()" in r["failed"] and "HINT: " in r["failed"], r


def test_an_uncaught_failure_ends_the_job_with_its_traceback(tmp_path: Path) -> None:
    code, out = run_job(tmp_path, "fail")
    assert code != 0, out[-6000:]
    lines = meaningful(out)
    assert any("ZeroDivisionError: division by zero" in line and "worker:0" in line for line in lines), out[-6000:]


JAX_SCRIPT = r'''
import json, os, sys, time
import keras_distrib
from keras_distrib import OnceError

out, task = sys.argv[1], os.environ["KERAS_DISTRIB_TASK"]
result = {"task": task}


def prepare():
    with open(os.path.join(out, "ran.log"), "a") as fh:
        fh.write(task + "\n")
    time.sleep(2)
    return "ran"


result["returned"] = keras_distrib.once(prepare)
try:
    keras_distrib.once(lambda: {}["missing"], name="lookup")
except (OnceError, KeyError) as exc:
    result["failed"] = f"{type(exc).__name__}: {exc}"
with open(os.path.join(out, f"result-{task}.json"), "w") as fh:
    json.dump(result, fh)
'''


def test_once_in_the_jax_layout(tmp_path: Path) -> None:
    """Two JAX processes: the wait goes through JAX's distributed client instead."""
    (tmp_path / "jax_once.py").write_text(JAX_SCRIPT)
    proc = start_local(["--nodes", "2", "--layout", "jax", "--port-base", str(port_base()), "--max-restarts", "0",
                        "jax_once.py", str(tmp_path)], tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    assert (tmp_path / "ran.log").read_text().split() == ["worker:0"]
    first, second = (json.loads((tmp_path / f"result-worker:{i}.json").read_text()) for i in (0, 1))
    assert first == {"task": "worker:0", "returned": "ran", "failed": "KeyError: 'missing'"}, first
    assert second["returned"] is None, second
    assert second["failed"].startswith("OnceError: keras_distrib.once(lookup) failed on worker:0 on local0 "
                                       "(KeyError: 'missing'); worker:1 did not run it. HINT: "), second
