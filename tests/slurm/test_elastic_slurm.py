"""Issue 25 on the real Slurm test cluster, through scripts/sbatch/elastic.sbatch: n3's link
cut during training. The job goes on on n1 and n2 in the same allocation and ends with exit
0 and the exact step count; with the link back, n3 rejoins at the next checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmTestCluster

from test_launcher_slurm import REPO, TIMEOUT, assert_nothing_left, error_lines, meaningful, wait_for_text

ELASTIC = REPO / "scripts" / "sbatch" / "elastic.sbatch"
EPOCHS, STEPS = 3, 200
# The TF layouts: keras_distrib.fit, checkpointed; the accuracy of the final model on all the data.
#: Each epoch a run trains prints a line ``epoch-record [epoch, wall-clock start, end, examples
#: its steps saw, pid]`` (bench/chaos.py checks that an undisturbed epoch saw the data once).
EPOCH_RECORD = r'''
import json, os, time
import keras


class Seen(keras.metrics.Metric):
    """Examples the steps of an epoch saw (rows of weight 0 are padding, not examples)."""

    def __init__(self, name="seen", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        rows = keras.ops.ones_like(keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "float32"))
        if sample_weight is not None:
            rows = keras.ops.cast(keras.ops.reshape(sample_weight, (-1,)) > 0, "float32")
        self.total.assign_add(keras.ops.sum(rows))

    def result(self):
        return keras.ops.cast(self.total, self.dtype)  # a tensor, not the variable (JAX traces it)


class EpochRecord(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        row = [epoch, self.start, time.time(), float((logs or {}).get("seen", -1)), os.getpid()]
        print("epoch-record", json.dumps(row), flush=True)
'''
# argv: directory, epochs, steps per epoch (0: one pass over the data), examples (default 2000),
# batch size (default 32).
FIT = EPOCH_RECORD + r'''
import json, sys
import numpy as np
import keras_distrib
import keras_distrib.trainers

strategy = keras_distrib.strategy()

directory, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) or None
examples = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
batch_size = int(sys.argv[5]) if len(sys.argv) > 5 else 32
rng = np.random.default_rng(0)
x = rng.normal(size=(examples, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy", Seen()])
keras_distrib.fit(model, (x, y), epochs=epochs, steps_per_epoch=steps, batch_size=batch_size, verbose=2, checkpoint_dir=directory,
                  callbacks=[EpochRecord()])
step = int(keras_distrib.trainers.trainer_for(model).global_step.numpy())
accuracy = keras_distrib.evaluate(model, (x, y), batch_size=250, return_dict=True, verbose=0)["accuracy"]
print(json.dumps({"step": step, "accuracy": float(accuracy)}), flush=True)
'''
# The jax layout: plain model.fit, resumed by keras_distrib.backup_and_restore (docs/jax.md).
JAX_FIT = EPOCH_RECORD + r'''
import json, sys
import numpy as np
import tensorflow as tf
import keras_distrib

keras_distrib.distribution()
info = keras_distrib.cluster()
backup, epochs = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
# A global batch of 48 divides over 3 processes as over 2: no row is left out (docs/jax.md).
x = rng.normal(size=(2880, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2880, seed=1).batch(48)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy", Seen()])
model.fit(train, epochs=epochs, callbacks=[keras_distrib.backup_and_restore(backup), EpochRecord()], verbose=2 if info.is_chief else 0)
accuracy = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(240), return_dict=True, verbose=0)["accuracy"]
if info.is_chief:
    print(json.dumps({"step": int(model.optimizer.iterations.numpy()), "accuracy": float(accuracy)}), flush=True)
'''
JAX_EPOCHS, JAX_EXAMPLES = 8, 2880
JAX_STEPS = JAX_EXAMPLES // 48


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("elastic-slurm")
    (path / "fit.py").write_text(FIT)
    (path / "fit_jax.py").write_text(JAX_FIT)
    return path


def final_row(text: str) -> dict:
    """The result line of fit.py on the first node: the chief's (on the JAX ps trainer the
    workers print one too), or worker 0's in all-reduce."""
    rows = [(line.startswith("[n1 chief:0]"), json.loads(line.split("] ", 1)[1])) for line in meaningful(text)
            if line.startswith("[n1 ") and line.split("] ", 1)[-1].startswith("{")]
    assert rows, text[-3000:]
    chiefs = [row for chief, row in rows if chief]
    return chiefs[-1] if chiefs else rows[-1][1]


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def link_back_after_the_end(cluster: SlurmTestCluster, out: Path) -> None:
    """n3 cut until the job's end: the first agent ends the step (the template reports its
    code), then the link comes back so n3's agent can stop."""
    assert wait_for_text(out, "ending the step (scancel ", TIMEOUT), out.read_text(errors="replace")[-4000:]
    time.sleep(3)
    cluster.set_link("n3", up=True)


# Each layout once and each path once in CI (about 55 s a case); KERAS_DISTRIB_ELASTIC_GRID=all runs
# all six (done for the figures in docs/faults.md).
CASES = [("ps-per-node", True), ("allreduce", False), ("jax", False)]
if os.environ.get("KERAS_DISTRIB_ELASTIC_GRID") == "all":
    CASES = [(layout, back) for layout in ("ps-per-node", "allreduce", "jax") for back in (False, True)]


@pytest.mark.parametrize(("layout", "back"), CASES,
                         ids=[f"{layout}-{'comes-back' if back else 'stays-cut'}" for layout, back in CASES])
def test_a_cut_node_is_dropped_and_rejoins_when_its_link_is_back(slurm_cluster: SlurmTestCluster, work: Path,
                                                                 layout: str, back: bool) -> None:
    name = f"{layout}-{'back' if back else 'cut'}"
    out, ck = work / f"{name}.out", work / f"{name}-ck"
    jax = layout == "jax"
    if jax:
        pytest.importorskip("jax", reason="the [jax] extra is not installed")
    # Coming back takes the heartbeat timeout and a checkpoint after it: the job must still run by then.
    epochs = 10 if back and not jax else EPOCHS
    script = ["fit_jax.py", str(ck), str(JAX_EPOCHS)] if jax else ["fit.py", str(ck), str(epochs), str(STEPS)]
    argv = ["sbatch", "--parsable", "-N3", "--cpus-per-task=2", "-o", str(out), str(ELASTIC),
            "--heartbeat-timeout", "10", "--checkpoint-every", "2s", *script]
    env = {"LAYOUT": layout, "JAX_PLATFORMS": "cpu"}
    job = int(slurm_cluster.head(argv, env=env, cwd=work, check=True, timeout=60).stdout.split(";")[0])
    saved = "training_metadata.json" if jax else "ckpt-*"
    cut = False
    try:
        deadline = time.monotonic() + TIMEOUT  # cut once a checkpoint exists: the survivors resume from it
        while not any(ck.glob(saved)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any(ck.glob(saved)), out.read_text(errors="replace")[-4000:]
        slurm_cluster.set_link("n3", up=False)
        cut, started = True, time.monotonic()
        assert wait_for_text(out, "lost n3; continuing on 2 nodes (n1, n2)", 60), out.read_text(errors="replace")[-4000:]
        lost_after = time.monotonic() - started
        if back:
            time.sleep(5)
            slurm_cluster.set_link("n3", up=True)
            cut = False
            assert wait_for_text(out, "n3 rejoined; continuing on 3 nodes (n1, n2, n3)", 120), \
                out.read_text(errors="replace")[-4000:]
        else:
            link_back_after_the_end(slurm_cluster, out)
            cut = False
        result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    finally:
        if cut:
            slurm_cluster.set_link("n3", up=True)
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    print(f"\n{name}: link cut -> 'lost n3' line {lost_after:.1f} s (heartbeat timeout 10 s)")
    for line in lines_with(text, "continuing on") + lines_with(text, "rejoin") + lines_with(text, "is back"):
        print(line)
    assert result == "COMPLETED" and result.exit_code == 0, text[-4000:]
    resumed = "from its last checkpoint" if jax else "from the checkpoint at epoch "
    assert len(lines_with(text, f"lost n3; continuing on 2 nodes (n1, n2) {resumed}")) == 1, text[-4000:]
    assert len(lines_with(text, "rejoined; continuing on")) == (1 if back else 0)
    done = final_row(text)
    print(done)
    assert done["step"] == (JAX_EPOCHS * JAX_STEPS if jax else epochs * STEPS), done
    # Undisturbed, this model reaches 0.98-0.99 on its data (the figure in docs/faults.md).
    assert done["accuracy"] >= 0.97, done
    assert error_lines(text) == []
    assert_nothing_left(slurm_cluster, job, wait=60)


def submit(cluster: SlurmTestCluster, work: Path, out: Path, ck: Path, epochs: int, layout: str = "ps-per-node",
           heartbeat_timeout: int = 10) -> int:
    argv = ["sbatch", "--parsable", "-N3", "--cpus-per-task=2", "-o", str(out), "--open-mode=append", str(ELASTIC),
            "--heartbeat-timeout", str(heartbeat_timeout), "--checkpoint-every", "2s", "fit.py", str(ck), str(epochs),
            str(STEPS)]
    return int(cluster.head(argv, env={"LAYOUT": layout}, cwd=work, check=True, timeout=60).stdout.split(";")[0])


def wait_for_checkpoint(ck: Path, out: Path, newer_than: float = 0.0) -> None:
    """Until a checkpoint written after ``newer_than`` (a time.time()) exists."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if any(p.stat().st_mtime > newer_than for p in ck.glob("ckpt-*")):
            return
        time.sleep(0.5)
    raise AssertionError(out.read_text(errors="replace")[-4000:])


@pytest.mark.skipif(os.environ.get("KERAS_DISTRIB_ELASTIC_GRID") != "all",
                    reason="about 2 min: run with KERAS_DISTRIB_ELASTIC_GRID=all (the figures in docs/faults.md)")
def test_a_second_node_lost_below_the_minimum_requeues_and_resumes(slurm_cluster: SlurmTestCluster,
                                                                    work: Path) -> None:
    """MIN_NODES 2 of 3: n3 lost, the job goes on on n1 and n2; n2 lost too, 1 node is below
    the minimum, so the job requeues itself (the template's --requeue), runs again on the
    three nodes once their links are back, and resumes from its last checkpoint to the end."""
    from test_resilience_slurm import wait_through_requeue

    out, ck = work / "below-min.out", work / "below-min-ck"
    job = submit(slurm_cluster, work, out, ck, epochs=10)  # long enough to lose n2 before the end
    cut: set[str] = set()
    try:
        wait_for_checkpoint(ck, out)
        slurm_cluster.set_link("n3", up=False)
        cut.add("n3")
        assert wait_for_text(out, "lost n3; continuing on 2 nodes (n1, n2)", 60), out.read_text(errors="replace")[-4000:]
        wait_for_checkpoint(ck, out, newer_than=time.time())  # the second generation saved one
        slurm_cluster.set_link("n2", up=False)
        cut.add("n2")
        assert wait_for_text(out, "lost the node n2", 60), out.read_text(errors="replace")[-4000:]
        assert wait_for_text(out, "requeued job", 60), out.read_text(errors="replace")[-4000:]
        for node in sorted(cut):
            slurm_cluster.set_link(node, up=True)
        cut.clear()
        result = wait_through_requeue(slurm_cluster, job)
    finally:
        for node in cut:
            slurm_cluster.set_link(node, up=True)
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    for line in lines_with(text, "continuing on") + lines_with(text, "lost the node") + lines_with(text, "resuming from"):
        print(line)
    assert result == "COMPLETED" and result.exit_code == 0, text[-4000:]
    assert len(lines_with(text, "lost n3; continuing on 2 nodes (n1, n2) from the checkpoint at epoch ")) == 1
    assert len(lines_with(text, "lost the node n2: its agent sent no heartbeat for")) == 1, text[-4000:]
    assert f"(scontrol requeue {job})" in text
    done = final_row(text)
    assert done["step"] == 10 * STEPS, done
    assert done["accuracy"] >= 0.97, done
    assert_nothing_left(slurm_cluster, job, wait=60)


def test_a_kill_during_the_reforming_is_restarted_and_the_job_ends(slurm_cluster: SlurmTestCluster,
                                                                   work: Path) -> None:
    """n3 cut; as soon as the next generation's parameter server on n2 exists, it is killed
    (SIGKILL) while the job re-forms: the restart budget takes it, and the job ends with
    exit 0 and the exact step count."""
    from test_launcher_slurm import pid_of

    out, ck = work / "kill-reform.out", work / "kill-reform-ck"
    job = submit(slurm_cluster, work, out, ck, epochs=EPOCHS)
    cut = False
    try:
        wait_for_checkpoint(ck, out)
        before = pid_of(slurm_cluster, "n2", "ps:1")
        slurm_cluster.set_link("n3", up=False)
        cut = True
        assert wait_for_text(out, "lost n3; continuing on 2 nodes (n1, n2)", 60), out.read_text(errors="replace")[-4000:]
        deadline = time.monotonic() + 60
        while (pid := pid_of(slurm_cluster, "n2", "ps:1")) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid != before, out.read_text(errors="replace")[-4000:]
        os.kill(pid, signal.SIGKILL)
        link_back_after_the_end(slurm_cluster, out)
        cut = False
        result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    finally:
        if cut:
            slurm_cluster.set_link("n3", up=True)
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    for line in lines_with(text, "continuing on") + lines_with(text, "exited with signal"):
        print(line)
    assert result == "COMPLETED" and result.exit_code == 0, text[-4000:]
    assert len(lines_with(text, "ps:0 on n2 exited with signal 9 (SIGKILL); restarting it")
               + lines_with(text, "ps:1 on n2 exited with signal 9 (SIGKILL); restarting it")) == 1, text[-4000:]
    done = final_row(text)
    assert done["step"] == EPOCHS * STEPS, done
    assert done["accuracy"] >= 0.97, done
    assert error_lines(text) == []
    assert_nothing_left(slurm_cluster, job, wait=60)


def agent_pids(cluster: SlurmTestCluster, node: str) -> list[int]:
    """The keras_distrib agents running in ``node``'s network namespace."""
    netns = os.stat(f"/run/netns/{cluster.prefix}-{node}").st_ino
    pids = []
    for entry in cluster.processes_matching(r"-m keras_distrib\.slurm"):
        pid = int(entry.split()[0])
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == netns:
                pids.append(pid)
        except OSError:
            continue
    return pids


def test_a_new_agent_started_with_join_takes_a_lost_node_back(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    """n3 cut and its agent killed (a node that went down); once n3 is back, a new agent
    started for the running job (srun --jobid=J -N1 -w n3 --overlap ... --join) joins at the
    next checkpoint, and the job ends on the three nodes with exit 0 and the exact step count."""
    import subprocess

    out, ck, joined = work / "join.out", work / "join-ck", work / "join-agent.out"
    epochs = 10
    job = submit(slurm_cluster, work, out, ck, epochs=epochs)
    cut, joiner = False, None
    try:
        wait_for_checkpoint(ck, out)
        slurm_cluster.set_link("n3", up=False)
        cut = True
        assert wait_for_text(out, "lost n3; continuing on 2 nodes (n1, n2)", 60), out.read_text(errors="replace")[-4000:]
        for pid in agent_pids(slurm_cluster, "n3"):  # n3 went down: its agent is gone
            os.kill(pid, signal.SIGKILL)
        slurm_cluster.set_link("n3", up=True)
        cut = False
        argv = ["srun", f"--jobid={job}", "-N1", "-w", "n3", "--overlap", "python", "-m", "keras_distrib.slurm",
                "--join", "--layout", "ps-per-node", "--min-nodes", "2", "--requeue", "--heartbeat-timeout", "10",
                "--checkpoint-every", "2s", "fit.py", str(ck), str(epochs), str(STEPS)]
        with joined.open("w") as sink:
            joiner = slurm_cluster.popen("head", argv, cwd=work, stdout=sink, stderr=subprocess.STDOUT)
        assert wait_for_text(out, "n3 rejoined; continuing on 3 nodes (n1, n2, n3)", 120), \
            out.read_text(errors="replace")[-3000:] + joined.read_text(errors="replace")[-3000:]
        result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
        joiner.wait(timeout=60)
    finally:
        if cut:
            slurm_cluster.set_link("n3", up=True)
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
            joiner.wait()
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text, agent = out.read_text(errors="replace"), joined.read_text(errors="replace")
    for line in lines_with(text, "continuing on") + lines_with(text, "is back") + lines_with(agent, "keras_distrib:"):
        print(line)
    assert result == "COMPLETED" and result.exit_code == 0, text[-4000:]
    assert joiner.returncode == 0, agent[-3000:]
    assert len(lines_with(text, "n3 is back (its agent connected again); it joins at the job's next checkpoint.")) == 1
    assert "connected to the first node's agent; it takes this node in at the job's next checkpoint." in agent
    done = final_row(text)
    assert done["step"] == epochs * STEPS, done
    assert done["accuracy"] >= 0.97, done
    assert error_lines(text) == [] and error_lines(agent) == []
    assert_nothing_left(slurm_cluster, job, wait=60)


def test_an_agent_that_does_not_acknowledge_the_end_is_named_and_the_step_ended(slurm_cluster: SlurmTestCluster,
                                                                                work: Path) -> None:
    """n3's agent frozen (SIGSTOP) in the last epoch, its silence shorter than the heartbeat
    timeout when training ends (as a node cut off then): srun would wait for its task until
    the time limit. The first agent names it within 13 s of its stop and ends the step; the
    job ends COMPLETED with exit 0, and nothing is left running."""
    out, ck = work / "unacknowledged.out", work / "unacknowledged-ck"
    job = submit(slurm_cluster, work, out, ck, epochs=EPOCHS, heartbeat_timeout=120)
    frozen: list[int] = []
    try:
        assert wait_for_text(out, f"Epoch {EPOCHS}/{EPOCHS}", TIMEOUT), out.read_text(errors="replace")[-4000:]
        frozen = agent_pids(slurm_cluster, "n3")
        assert frozen, "no agent on n3"
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    finally:
        for pid in frozen:  # gone with the step, or left for the cleanup
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    for line in lines_with(text, "acknowledge") + lines_with(text, "ending the step"):
        print(line)
    assert result == "COMPLETED" and result.exit_code == 0, text[-4000:]
    named = lines_with(text, "the agent on n3 did not acknowledge the end of the job within 13 s")
    assert len(named) == 1 and "HINT:" in named[0], text[-4000:]
    assert len(lines_with(text, "ending the step (scancel ")) == 1, text[-4000:]
    done = final_row(text)
    assert done["step"] == EPOCHS * STEPS, done
    assert done["accuracy"] >= 0.97, done
    assert_nothing_left(slurm_cluster, job, wait=60)
