"""Tiny training jobs for the launch and shutdown benchmarks (local mode vs by hand)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import child_env, parser

# Runs as the chief (PS layouts) or every worker (allreduce). Under keras_distrib it
# takes the strategy from the launcher; by hand, from TF_CONFIG. Writes the wall time of
# its first completed step to MARK_FILE, and of its exit to MARK_FILE.exit.TASK. It ends
# with os._exit so that "exit" is the moment the process is gone, not the start of
# TensorFlow's own interpreter teardown (about 1 s, the same with or without a launcher).
FIRST_STEP_SCRIPT = '''
import json, os, sys, time
mark = os.environ["MARK_FILE"]
import tensorflow as tf
import keras
if "KERAS_DISTRIB_PLAN_FILE" in os.environ:
    import keras_distrib
    strategy = keras_distrib.strategy()
else:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = (tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
                if task["type"] == "worker" else tf.distribute.experimental.ParameterServerStrategy(resolver))
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    opt = keras.optimizers.SGD(0.01)
x = tf.random.normal([16, 8]); y = tf.random.normal([16, 4])
@tf.function
def step():
    def replica():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return strategy.run(replica)
if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    coordinator.schedule(step).fetch()
else:
    step()
if not os.path.exists(mark):
    open(mark, "w").write(repr(time.time()))
with open(mark + ".exit." + os.environ.get("KERAS_DISTRIB_TASK", "x"), "w") as fh:
    fh.write(repr(time.time()))
os._exit(0)
'''

SERVER_CODE = (
    "import json, os, tensorflow as tf\n"
    "c = json.loads(os.environ['TF_CONFIG'])\n"
    "tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), job_name=c['task']['type'],"
    " task_index=c['task']['index']).join()\n"
)


def write_script(workdir: Path) -> Path:
    path = workdir / "first_step.py"
    path.write_text(FIRST_STEP_SCRIPT)
    return path


def free_port_base(count: int) -> int:
    """A base port with ``count`` free ports after it (checked by binding)."""
    for base in range(31000, 32700, count + 1):
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(count + 1)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError("no free port range")


def run_keras_distrib(workdir: Path, nodes: int, layout: str) -> tuple[float, float, float]:
    """(launch->first step, script exit->last process gone, launch->end) in seconds, local mode."""
    mark = workdir / f"mark-{time.monotonic_ns()}"
    script = write_script(workdir)
    env = child_env(MARK_FILE=str(mark))
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", str(nodes), "--layout", layout,
         "--port-base", str(free_port_base(3 * nodes + 2)), str(script)],
        env=env, cwd=workdir, capture_output=True, text=True, timeout=300,
    )
    end = time.time()
    if proc.returncode != 0 or not mark.exists():
        useful = [line for line in (proc.stdout + proc.stderr).splitlines()
                  if "keras_distrib" in line or "Error" in line or "Traceback" in line]
        raise SystemExit(f"keras_distrib run ({layout}) failed with {proc.returncode}:\n" + "\n".join(useful[-40:]))
    exits = [float(p.read_text()) for p in workdir.glob(f"{mark.name}.exit.*")]
    return float(mark.read_text()) - start, end - max(exits), end - start


def run_by_hand(workdir: Path, nodes: int) -> float:
    """Launch->first step for the same ps-per-node processes started by hand with TF_CONFIG."""
    mark = workdir / f"mark-{time.monotonic_ns()}"
    script = write_script(workdir)
    base = free_port_base(3 * nodes + 1)
    ports = iter(range(base, base + 3 * nodes + 1))
    cluster = {"chief": [f"127.0.0.1:{next(ports)}"], "ps": [], "worker": []}
    for _ in range(nodes):
        cluster["ps"].append(f"127.0.0.1:{next(ports)}")
        cluster["worker"].append(f"127.0.0.1:{next(ports)}")
    start = time.time()
    servers = []
    for job in ("ps", "worker"):
        for index in range(nodes):
            env = child_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": job, "index": index}}),
                            CUDA_VISIBLE_DEVICES="")
            servers.append(subprocess.Popen([sys.executable, "-c", SERVER_CODE], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    env = child_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}),
                    MARK_FILE=str(mark), CUDA_VISIBLE_DEVICES="")
    chief = subprocess.run([sys.executable, "-u", str(script)], env=env, capture_output=True, text=True, timeout=300)
    for s in servers:
        s.kill()
        s.wait()
    if chief.returncode != 0 or not mark.exists():
        raise SystemExit(f"hand-written run failed:\n{chief.stderr[-3000:]}")
    return float(mark.read_text()) - start


def launcher_args(doc: str | None) -> tuple[Any, int, int]:
    """(args, rounds, emulated nodes) for the launcher benchmarks; --smoke shrinks both to 1."""
    p = parser(doc or "")
    p.add_argument("--nodes", type=int, default=2)
    args = p.parse_args()
    return args, 1 if args.smoke else args.rounds, 1 if args.smoke else args.nodes

