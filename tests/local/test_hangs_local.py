"""Hangs in local mode: a process frozen with SIGSTOP mid-training is named, its stacks kept, restarted.

One ps-per-node job takes three freezes in turn (a worker, a ps, the chief); the all-reduce job one
(a worker, which makes its peer exit: the frozen one must be named, not the peer). Each run
must name the frozen process within a bounded time, then end with exit code 0, the exact
step count and nothing left running. --hang-timeout is short here (20 s) so the tests
end; timings are not asserted beyond a generous bound (the machine is shared).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from launcher_utils import alive, wait_for
from test_resilience_local import COUNTED, SCRIPT, Job, checkpoints, lost_examples, newer_checkpoint

HANG_TIMEOUT = 20
# The naming line comes HANG_TIMEOUT after the freeze plus a poll or two; a loaded machine
# (TF processes of other tests) may add much more.
NAMED_WITHIN = HANG_TIMEOUT + 180


class HungJob(Job):
    def stop(self, task: str, timeout: float = 300) -> int:
        """SIGSTOP ``task`` (it stays alive, its sockets open); its pid."""
        assert wait_for(lambda: len(self.pids(task)) == 1, timeout), f"{task} never ran\n{self.text()[-3000:]}"
        pid = self.pids(task)[0]
        os.kill(pid, signal.SIGSTOP)
        return pid

    def named(self, pattern: str) -> list[str]:
        return [line for line in self.lines if re.search(pattern, line)]


def stacks_files(job: Job) -> dict[str, str]:
    """The stacks files the job's lines point to: {path: text}."""
    found = {}
    for line in job.lines:
        for path in re.findall(r"its Python stacks: (\S+\.stacks\.txt)", line):
            found[path] = Path(path).read_text() if Path(path).is_file() else ""
    return found


def test_ps_layout_names_and_restarts_a_frozen_worker_a_frozen_ps_and_a_frozen_chief(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    epochs, steps = 12, 300
    job = HungJob(["--nodes", "2", "--port-base", "26100", "--checkpoint-every", "1s", "--startup-timeout", "600",
                   "--hang-timeout", str(HANG_TIMEOUT), str(SCRIPT), str(ck), str(epochs), str(steps)], tmp_path)
    stopped = []
    try:
        for n, (task, then) in enumerate((("worker:1", "restarting it (1/3)"),
                                          ("ps:1", "restarting it and the chief's SCRIPT, which resumes"),
                                          ("chief:0", "restarting it (3/3)"))):
            before = checkpoints(ck)
            assert wait_for(lambda: newer_checkpoint(ck, before), 600), f"no new checkpoint before {task}\n{job.text()[-3000:]}"
            stopped.append(job.stop(task))
            frozen_at = time.monotonic()
            line = rf"{task} on local{0 if task == 'chief:0' else 1} made no progress for \d+ s \(state: stopped\); its Python stacks: .*{task.replace(':', '-')}\.stacks\.txt"
            assert wait_for(lambda: len(job.named(line)) == 1, NAMED_WITHIN), f"{task} not named\n{job.text()[-3000:]}"
            # Not before the timeout; the chief's silence began at its last count, up to a
            # chunk before the freeze (seen: named 18 s after its SIGSTOP with a 20 s timeout).
            assert time.monotonic() - frozen_at >= (HANG_TIMEOUT / 2 if task == "chief:0" else HANG_TIMEOUT - 1)
            assert then in job.named(line)[0], job.named(line)
            print(job.named(line)[0])
            assert len(job.named(r"made no progress")) == n + 1  # the chief it silenced is not named
        code = job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 0, job.text()[-4000:]
    # A worker frozen after its closure counted, killed, then runs it again: the closure counts
    # twice, and the chief sets the counter back (docs/faults.md, Restarts).
    assert job.result("[local0 chief:0]")["step"] == epochs * steps
    files = stacks_files(job)
    assert len(files) == 3 and all("made no progress" in text and "thread" in text for text in files.values()), files
    assert not alive(sorted(job.seen | set(stopped)))


def test_allreduce_names_the_frozen_worker_not_the_peer_that_exited(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    epochs, steps = 3, 150
    job = HungJob(["--nodes", "2", "--layout", "allreduce", "--verbose", "--port-base", "26200", "--checkpoint-every",
                   "20steps", "--startup-timeout", "600", "--hang-timeout", str(HANG_TIMEOUT), str(SCRIPT), str(ck),
                   str(epochs), str(steps)], tmp_path)
    try:
        assert wait_for(lambda: bool(checkpoints(ck)), 600), job.text()[-3000:]
        pid = job.stop("worker:1")
        # Either the peer exits first (TF's coordination service: "stopped sending heartbeats")
        # or the watchdog names it first: both lines name worker:1, and restart all workers.
        line = r"worker:1 on local1 (stopped sending heartbeats|made no progress).*restarting all 2 workers"
        assert wait_for(lambda: len(job.named(line)) == 1, NAMED_WITHIN), job.text()[-3000:]
        print(job.named(line)[0])
        code = job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 0, job.text()[-4000:]
    assert not job.named("worker:0 on local0 exited unexpectedly"), job.text()[-3000:]
    first, second = job.result("[local0 worker:0]"), job.result("[local1 worker:1]")
    assert first["step"] == second["step"] == epochs * steps
    assert first["weights"] == second["weights"]
    assert stacks_files(job), job.text()[-3000:]
    assert not alive(sorted(job.seen | {pid}))


def test_a_worker_frozen_in_a_counted_epoch_of_files_is_named_restarted_and_later_epochs_are_exact(
        tmp_path: Path) -> None:
    """ps, files in a cache (`FileSource(cache=True)`): the first epoch counts each worker's
    batches, the later ones send unguarded closures. A worker frozen in the third epoch holds
    it until --hang-timeout, is named, killed and restarted; the fit ends, and the epochs
    other than the frozen one see every example once."""
    epochs, frozen = 4, 2
    job = HungJob(["--nodes", "2", "--port-base", "26400", "--startup-timeout", "600", "--hang-timeout",
                   str(HANG_TIMEOUT),
                   str(COUNTED), str(tmp_path), str(epochs)], tmp_path)
    try:
        assert wait_for(lambda: (tmp_path / f"started-{frozen}").exists(), 600), job.text()[-3000:]
        pid = job.stop("worker:1")
        line = r"worker:1 on local1 made no progress for \d+ s \(state: stopped\).*restarting it \(1/3\)"
        assert wait_for(lambda: len(job.named(line)) == 1, NAMED_WITHIN), job.text()[-3000:]
        code = job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 0, job.text()[-4000:]
    assert len(job.named("made no progress")) == 1, job.text()[-3000:]  # not the idle worker, not the chief
    result = job.result("[local0 chief:0]")
    n = result["n"]
    exact = [e for e in range(epochs) if e != frozen]
    assert [result["count"][e] for e in exact] == [n] * len(exact), result
    assert [result["idsum"][e] for e in exact] == [n * (n - 1) / 2] * len(exact), result
    assert result["count"][frozen] + lost_examples(job, batch_size=2) >= n, result
    assert not alive(sorted(job.seen | {pid}))


@pytest.mark.parametrize("max_restarts", [0])
def test_a_frozen_ps_without_restarts_fails_the_job_naming_it(tmp_path: Path, max_restarts: int) -> None:
    (tmp_path / "counting.py").write_text(COUNTING)
    job = HungJob(["--nodes", "2", "--port-base", "26300", "--max-restarts", str(max_restarts), "--hang-timeout", "5",
                   "counting.py"], tmp_path)
    stop_and_expect_one_error(job, "ps:1", r"ps:1 on local1 made no progress for \d+ s \(state: stopped\); its "
                                          r"Python stacks: \S+ps-1\.stacks\.txt.*HINT:")


def stop_and_expect_one_error(job: "HungJob", name: str, pattern: str) -> None:
    """Freeze ``name``; the job must fail with one error line matching ``pattern`` and leave nothing running."""
    try:
        pid = job.stop(name)
        code = job.wait(timeout=NAMED_WITHIN)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 1, job.text()[-3000:]
    errors = [line for line in job.lines if "error:" in line]
    assert len(errors) == 1 and re.search(pattern, errors[0]), job.text()[-3000:]
    assert not alive(sorted(job.seen | {pid}))


# A SCRIPT that counts progress without TensorFlow training (fast to start).
COUNTING = """\
import time
from keras_distrib import progress
for _ in range(600):
    progress.tick()
    time.sleep(0.1)
"""


def test_a_frozen_jax_process_is_named(tmp_path: Path) -> None:
    """Keras' own fit on JAX counts no progress: the /proc probe names the stopped process."""
    pytest.importorskip("jax", reason="the [jax] extra is not installed")
    from launcher_utils import REPO

    job = HungJob(["--nodes", "2", "--layout", "jax", "--max-restarts", "0", "--hang-timeout", "10",
                   str(REPO / "examples" / "digits_jax.py"), "--epochs", "500", "--verbose", "2"], tmp_path)
    try:
        assert wait_for(lambda: job.count("Epoch 2/500") >= 1, 600), job.text()[-3000:]
    except BaseException:
        job.proc.kill()
        raise
    stop_and_expect_one_error(job, "worker:1", r"worker:1 on local1 made no progress for \d+ s \(state: stopped\); "
                                               r"its Python stacks: \S+worker-1\.stacks\.txt")
