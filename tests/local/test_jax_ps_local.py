"""The parameter-server layouts on Keras 3's JAX backend, in local mode: the TensorFlow ps
script unchanged under KERAS_BACKEND=jax, exact epochs, a killed worker, resume, the .keras file."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from docs_blocks import command_lines
from launcher_utils import Job, alive, launcher_env, wait_for
from test_hangs_local import HANG_TIMEOUT, HungJob

pytest.importorskip("jax", reason="the [jax] extra is not installed")

pytestmark = pytest.mark.local

SCRIPT = Path(__file__).resolve().parent / "jax_ps_script.py"
ROWS = 1003  # batch 32: 31 full batches and one of 11
SEED = random.randrange(1 << 30)


def history_of(job: Job) -> dict:
    rows = [json.loads(line.split("] ", 1)[1]) for line in job.lines
            if line.startswith("[local0 chief:0]") and '] {"history"' in line]
    assert rows, job.text()[-3000:]
    return rows[-1]


def assert_exact(history: dict, epochs: int, rows: int = ROWS) -> None:
    """Every example once per epoch: the count and the sum of the ids (mod 1000, as the script)."""
    assert history["id_count"] == [rows] * epochs, history["id_count"]
    assert history["id_idsum"] == [float(sum(i % 1000 for i in range(rows)))] * epochs, history["id_idsum"]


def single_process(workdir: Path, epochs: int) -> dict:
    """The same script in one plain JAX process (keras_distrib.fit is model.fit there)."""
    workdir.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), str(workdir), str(epochs), str(ROWS)], cwd=workdir,
                          env=launcher_env(KERAS_BACKEND="jax"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["history"]


def test_the_tensorflow_ps_script_runs_unchanged_on_jax_exactly_and_resumes(tmp_path: Path) -> None:
    """2 nodes: every epoch trains on every example once; accuracy as one JAX process; the
    .keras file loads in a plain TensorFlow-backend process with the same predictions; the same
    command again finds every epoch done and ends well."""
    epochs = 3
    [command] = command_lines("jax-ps-command")  # docs/training.md's own command
    assert command[0] == "KERAS_BACKEND=jax" and command[1:4] == ["python", "-m", "keras_distrib.local"], command
    assert command[-1] == "train.py", command
    options = command[4:-1]
    job = Job([*options, "--startup-timeout", "600", str(SCRIPT), str(tmp_path), str(epochs), str(ROWS)], tmp_path,
              KERAS_BACKEND="jax")
    assert job.wait() == 0, job.text()[-4000:]
    result = history_of(job)
    assert_exact(result["history"], epochs)
    assert result["step"] == epochs * 32, result["step"]  # ROWS in batches of 32: 32 an epoch
    assert all(f"epoch {e}/{epochs}" in job.text() for e in range(1, epochs + 1)), job.text()[-3000:]
    alone = single_process(tmp_path / "alone", epochs)
    # Both sides start from the same weights (the script seeds Keras): from different ones, one
    # process alone ended 3 epochs anywhere in 0.89-0.96 on these 400 examples. The last two
    # epochs' mean on each side: the asynchronous updates interleave differently in every run.
    def settled(history: dict) -> float:
        return sum(history["val_label_accuracy"][-2:]) / 2

    assert settled(result["history"]) >= settled(alone) - 0.02, (result["history"]["val_label_accuracy"],
                                                                 alone["val_label_accuracy"])

    check = ("import json, sys, keras, numpy as np\n"
             "m = keras.models.load_model(sys.argv[1], compile=False)\n"
             "x = np.random.default_rng(0).normal(size=(%d, 16)).astype('float32')[%d:%d]\n"
             "print(json.dumps(np.asarray(m.predict(x, verbose=0)['label']).tolist()))" % (ROWS + 400, ROWS, ROWS + 8))
    reload = subprocess.run([sys.executable, "-c", check, str(tmp_path / "model.keras")], capture_output=True,
                            text=True, timeout=300, env=launcher_env(KERAS_BACKEND="tensorflow"))
    assert reload.returncode == 0, reload.stderr[-3000:]
    reloaded = json.loads(reload.stdout.strip().splitlines()[-1])
    assert max(abs(a - b) for r, s in zip(reloaded, result["probe"]) for a, b in zip(r, s)) < 1e-4

    again = Job([*options, "--startup-timeout", "600", str(SCRIPT), str(tmp_path), str(epochs), str(ROWS)], tmp_path,
                KERAS_BACKEND="jax")
    assert again.wait() == 0, again.text()[-4000:]
    assert again.count(f"every one of the {epochs} epochs was done") == 1, again.text()[-3000:]
    # The History of a finished fit's rerun: every epoch's logs, kept with the checkpoint.
    assert history_of(again)["history"]["id_count"] == result["history"]["id_count"]
    assert history_of(again)["step"] == epochs * 32
    assert not alive(job.seen | again.seen)


def test_a_killed_worker_then_a_preemption_then_a_resume_keep_every_epoch_exact(tmp_path: Path) -> None:
    """3 nodes, 3 workers: worker 1 killed in the second epoch (its parts run again elsewhere, or
    on it, restarted); a SIGUSR1 in the third saves where the epoch is and every SCRIPT process
    exits 75; the same command resumes inside that epoch, and every epoch counts each example once."""
    epochs, rows = 4, 12_003  # about 1-3 s an epoch: the kill lands inside it
    # --max-restarts 6: room for the ps tasks' rare start-up crash (PS_START_CRASH, seen twice in one run)
    args = ["--nodes", "3", "--layout", "ps-per-node", "--startup-timeout", "600", "--max-restarts", "6", str(SCRIPT),
            str(tmp_path), str(epochs), str(rows)]
    job = Job(args, tmp_path, KERAS_BACKEND="jax")

    def kill_then_preempt() -> None:
        assert wait_for(lambda: (tmp_path / "started-1").exists(), 600), job.text()[-3000:]
        time.sleep(random.Random(SEED).uniform(0, 0.5))
        job.kill("worker:1")
        assert wait_for(lambda: (tmp_path / "started-2").exists(), 600), job.text()[-3000:]
        time.sleep(random.Random(SEED).uniform(0.2, 0.6))
        job.proc.send_signal(signal.SIGUSR1)

    code = job.wait_after(kill_then_preempt)
    agent = "\n".join(line for line in job.lines if " agent] " in line)
    assert code == 75, f"seed {SEED}\n{agent}\n{job.text()[-4000:]}"
    # (n/6): a ps task's rare start-up crash may have taken restarts first (PS_START_CRASH).
    assert re.search(r"worker:1 on local1 exited with signal 9 \(SIGKILL\); restarting it \([1-6]/6\)", agent), agent
    saved = [line for line in job.lines if "got SIGUSR1: saved a checkpoint in" in line]
    assert len(saved) == 1, job.text()[-3000:]
    assert all(job.count(f"worker:{w} on local{w} finished with exit code 75") == 1 for w in range(3)), agent
    assert not alive(job.seen)

    rerun = Job(args, tmp_path, KERAS_BACKEND="jax")
    assert rerun.wait() == 0, rerun.text()[-4000:]
    where = saved[0].split(" at ")[1].split(";")[0]  # "epoch 3, 200 of 376 batches into it"
    assert rerun.count(f"resuming from {tmp_path}/ckpt/jax-ps: {where}") == 1, (where, rerun.text()[-3000:])
    assert_exact(history_of(rerun)["history"], epochs, rows)
    assert history_of(rerun)["step"] == epochs * 376
    assert not alive(rerun.seen)
    assert os.path.exists(tmp_path / "model.keras")


INPUTS_SCRIPT = Path(__file__).resolve().parent / "jax_ps_inputs_script.py"
INPUT_KINDS = ["dataset", "batched", "unknown", "pydataset", "split", "steps"]


def test_every_input_kind_trains_each_example_once_per_epoch_with_three_workers(tmp_path: Path) -> None:
    """3 nodes: a shuffled tf.data.Dataset (unbatched, batched, of unknown size), a shuffled
    PyDataset and arrays with validation_split each train 2 exact epochs of 1,003 examples
    (short last batches; 3 workers reading the same stream), with their validation; an endless
    dataset with steps_per_epoch and validation_steps reads on across epochs."""
    job = Job(["--nodes", "3", "--layout", "ps-per-node", "--startup-timeout", "600", str(INPUTS_SCRIPT),
               str(tmp_path), str(ROWS), *INPUT_KINDS], tmp_path, KERAS_BACKEND="jax")
    assert job.wait() == 0, job.text()[-4000:]
    results, workers = {}, []
    for line in job.lines:
        if '] {"kind"' in line:
            row = json.loads(line.split("] ", 1)[1])
            if line.startswith("[local0 chief:0]"):
                results[row["kind"]] = row["history"]
            else:
                workers.append(row)
    assert sorted(results) == sorted(INPUT_KINDS), job.text()[-3000:]
    # Every worker's fit returned the chief's History (SCRIPT reads it unguarded on every process).
    assert len(workers) == 3 * len(INPUT_KINDS), job.text()[-3000:]
    assert all(row["history"] == results[row["kind"]] for row in workers), workers
    # steps_per_epoch=20 of an endless dataset of 32 batches a pass (the last of 11): epoch 1 is 20
    # whole batches, epoch 2 the 12 left of the pass (11 whole, 1 of 11) and 8 of the next.
    steps = results.pop("steps")
    assert steps["id_count"] == [640.0, 11 * 32 + 11 + 8 * 32], steps
    assert steps["val_id_count"] == [100.0, 100.0], steps
    for kind, history in results.items():
        assert_exact(history, 2)
        assert history["label_accuracy"][-1] > 0.8, (kind, history)
        if kind != "unknown":  # the only one without validation
            assert history["val_id_count"] == [200.0, 200.0], (kind, history)
    assert not alive(job.seen)


#: A ps task's rare crash in TensorFlow while the clients start (docs/training.md); the job recovers
#: by restarting every process, but with --max-restarts 0 it loses a node before the fault under test.
PS_START_CRASH = re.compile(r"ps:\d on local\d exited with signal 11 \(SIGSEGV\)")


def test_a_frozen_worker_is_named_and_its_lost_node_continues_on_the_survivors_exactly(tmp_path: Path) -> None:
    """3 nodes, --min-nodes 2, no restarts: worker 2 frozen (SIGSTOP) in the third epoch is named by
    the watchdog; with the restart budget spent, local2 is lost and the job re-forms on local0 and
    local1 from the epoch checkpoint (named in the line); every epoch counts each example once.
    A run that meets the ps start-up crash first is started once more (it says so)."""
    epochs, rows = 4, 12_003
    for attempt in range(2):
        workdir = tmp_path / f"run{attempt}"
        workdir.mkdir()
        job = HungJob(["--nodes", "3", "--min-nodes", "2", "--max-restarts", "0", "--hang-timeout",
                       str(HANG_TIMEOUT), "--layout", "ps-per-node", "--startup-timeout", "600", str(SCRIPT),
                       str(workdir), str(epochs), str(rows)], workdir, KERAS_BACKEND="jax")

        def freeze() -> None:
            assert wait_for(lambda: (workdir / "started-2").exists() or PS_START_CRASH.search(job.text()), 600), \
                job.text()[-3000:]
            if PS_START_CRASH.search(job.text()):
                return
            time.sleep(random.Random(SEED).uniform(0, 0.5))
            job.stop("worker:2")

        code = job.wait_after(freeze)
        if not PS_START_CRASH.search(job.text()):
            break
        print(f"run {attempt}: a ps task crashed at start-up, before the freeze; starting again")
    assert code == 0, f"seed {SEED}\n{job.text()[-4000:]}"
    lost = [line for line in job.lines if "; continuing on " in line]
    assert len(lost) == 1, job.text()[-3000:]
    found = re.search(r"lost local2; continuing on 2 nodes \(local0, local1\) from the checkpoint at epoch (\d), "
                      r"step (\d+) \(worker:2 on local2 made no progress for (\d+) s", lost[0])
    assert found and int(found.group(2)) == int(found.group(1)) * 376 and int(found.group(1)) >= 2, lost
    assert int(found.group(3)) >= HANG_TIMEOUT, lost  # its silence, which may have begun before the stop
    assert job.count(f"resuming from {workdir}/ckpt/jax-ps: epoch {found.group(1)} done") == 1, job.text()[-3000:]
    assert_exact(history_of(job)["history"], epochs, rows)
    assert history_of(job)["step"] == epochs * 376  # each batch once, the re-formed run's included
    assert not alive(job.seen)


def test_a_model_with_its_own_jax_train_step_trains_with_its_own_metrics_on_three_workers(tmp_path: Path) -> None:
    """A model whose stateless ``train_step`` and ``test_step`` are its own (gradient clipping,
    a metric of the gradients' norm, BatchNorm): the workers run that step, the chief sums each
    part's metric states, and it learns as one process does."""
    script = Path(__file__).resolve().parent / "jax_custom_step_script.py"
    epochs, rows = 3, 4003  # 126 batches an epoch: parts enough for every worker once it has compiled
    job = Job(["--nodes", "3", "--layout", "ps-per-node", "--startup-timeout", "600", str(script), str(tmp_path),
               str(epochs), str(rows)], tmp_path, KERAS_BACKEND="jax")
    assert job.wait() == 0, job.text()[-4000:]
    history = history_of(job)["history"]
    assert set(history) == {"loss", "accuracy", "grad_norm", "val_loss", "val_accuracy", "val_grad_norm"}, history
    assert len(history["grad_norm"]) == epochs and all(n > 0 for n in history["grad_norm"]), history
    assert history["val_grad_norm"] == [0.0] * epochs, history  # its own test_step leaves it alone
    # Asynchronous updates make any one epoch's accuracy noisy by points: the best epoch must reach 0.9.
    assert history["loss"][-1] < history["loss"][0] and max(history["val_accuracy"]) >= 0.9, history
    assert re.search(r"worker 2: \d+ steps", job.text()), job.text()[-3000:]  # three workers shared the epochs


def test_a_killed_ps_resumes_from_the_last_mid_epoch_checkpoint_exactly(tmp_path: Path) -> None:
    """--checkpoint-every 40steps: the chief checkpoints inside each epoch (the ps's values and the
    parts folded so far). A ps killed in the second epoch restarts every process; the chief resumes
    inside that epoch, not at its start, and every epoch still counts each example once."""
    epochs, rows = 3, 12_003  # 376 batches an epoch
    args = ["--nodes", "2", "--layout", "ps-per-node", "--startup-timeout", "600", "--checkpoint-every", "40steps",
            str(SCRIPT), str(tmp_path), str(epochs), str(rows)]
    job = Job(args, tmp_path, KERAS_BACKEND="jax")
    saved = tmp_path / "ckpt" / "jax-ps" / "epoch.json"

    def inside_second_epoch() -> int:
        try:
            within = json.loads(saved.read_text()).get("within") or {}
        except (OSError, ValueError):  # not there yet, or replaced as it was read
            return 0
        return int(within["steps"]) if within.get("epoch") == 1 else 0

    def kill_a_ps() -> None:
        assert wait_for(lambda: inside_second_epoch() >= 40, 600), job.text()[-3000:]
        job.kill("ps:0")

    code = job.wait_after(kill_a_ps)
    agent = "\n".join(line for line in job.lines if " agent] " in line)
    assert code == 0, f"{agent}\n{job.text()[-4000:]}"
    assert re.search(r"ps:0 on local0 exited with signal 9 \(SIGKILL\); restarting", agent), agent
    resumed = re.findall(r"resuming from \S+: epoch 2, (\d+) of 376 batches into it", job.text())
    assert len(resumed) == 1 and int(resumed[0]) >= 40, job.text()[-4000:]
    assert_exact(history_of(job)["history"], epochs, rows)
    assert history_of(job)["step"] == epochs * 376  # each batch counted once, in the run resumed inside epoch 2
    assert not alive(job.seen)
