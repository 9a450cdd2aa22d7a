"""Resilience on the real Slurm test cluster: a killed worker on another node is restarted
(the restart order crosses nodes on the control channel), and a time-limit warning
(``scancel --signal=USR1 --batch``, what ``#SBATCH --signal=B:USR1@120`` sends) makes the
job checkpoint, requeue itself and resume to the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import JobResult, SlurmTestCluster

from cluster_parsers import JobInfo
from keras_distrib.plan import build_plan, derive_port_base
from test_launcher_slurm import PS_PER_NODE, TIMEOUT, assert_nothing_left, error_lines, meaningful, pid_of, sbatch_template, wait_for_text

RESILIENCE_SCRIPT = Path(__file__).resolve().parents[1] / "local" / "resilience_script.py"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resilience-slurm")
    shutil.copy(RESILIENCE_SCRIPT, path / "fit.py")
    return path


def result_of(text: str) -> dict:
    rows = [json.loads(line.split("] ", 1)[1]) for line in meaningful(text) if line.startswith("[n1 chief:0] {")]
    assert rows, text[-3000:]
    return rows[-1]


# A stranger on the cluster network against the first node's control port, from the head
# node: a port scan, another protocol, random bytes, a forged agent, an oversized line and a
# sender that never authenticates (held past the 10 s handshake deadline).
FUZZ_CLIENT = r"""
import json, random, socket, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
rng = random.Random(7)
attacks = [(None, 0.0), (b"GET / HTTP/1.0\r\n\r\n", 0.5), (bytes(rng.randrange(256) for _ in range(3000)) + b"\n", 0.5),
           (json.dumps({"agent": 1, "node": "n2", "auth": "0" * 64}).encode() + b"\n", 0.5),
           (b'{"x": "' + b"a" * ((4 << 20) + 10), 1.0), (b'{"agent": 1', 12.0)]
def attack(payload, hold):
    with socket.create_connection((host, port), timeout=15) as sock:
        try:
            sock.sendall(payload or b"")
        except OSError:
            pass
        time.sleep(hold)
threads = [threading.Thread(target=attack, args=a) for a in attacks]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(attacks))
"""


def control_port_of(job: int) -> int:
    plan = build_plan(JobInfo("slurm", str(job), ("n1", "n2", "n3"), (1, 1, 1)), "ps-per-node", derive_port_base(str(job)))
    return plan.control_port()


def wait_through_requeue(cluster: SlurmTestCluster, job: int) -> JobResult:
    """The job's end state after its requeue: PENDING, then RUNNING again, then done."""
    deadline = time.monotonic() + 2 * TIMEOUT
    while True:
        result = cluster.wait_job(job, timeout=2 * TIMEOUT)
        if result != "REQUEUED" or time.monotonic() > deadline:
            return result


def test_killed_worker_on_another_node_is_restarted(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    """Meanwhile a fuzzing client attacks the control port: one log line per connection, and
    the job neither stops nor stalls (issue 11)."""
    out, ck = work / "restart.out", work / "restart-ck"
    job = sbatch_template(slurm_cluster, PS_PER_NODE, ["-N3", "--cpus-per-task=2", "-o", str(out)],
                          ["--checkpoint-every", "2s", "fit.py", str(ck), "6", "200"], work)
    try:
        assert wait_for_text(out, "Epoch 1/6", TIMEOUT), out.read_text(errors="replace") if out.exists() else "no output"
        fuzz = slurm_cluster.popen("head", [sys.executable, "-c", FUZZ_CLIENT, "n1", str(control_port_of(job))],
                                  stdout=subprocess.PIPE, text=True)
        os.kill(pid_of(slurm_cluster, "n2", "worker:1"), signal.SIGKILL)
        attacks = int(fuzz.communicate(timeout=60)[0].split()[-1])
        result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    finally:
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED", text[-4000:]
    strangers = [line for line in text.splitlines() if line.startswith(f"[n1 agent] keras_distrib: control port {control_port_of(job)}: connection from ")]
    assert len(strangers) == attacks, "\n".join(strangers)
    restart = "[n1 agent] keras_distrib: worker:1 on n2 exited with signal 9 (SIGKILL); restarting it (1/3)"
    assert restart in text
    # The n2 agent started it again (it may end with the job before it serves: training goes on without it).
    assert "[n2 worker:1] " in text[text.index(restart):], text[-3000:]
    # A closure that counted before its worker died runs again and counts again (1,210 for 1,200
    # seen once here): the chief sets the counter back (docs/faults.md, Restarts).
    assert result_of(text)["step"] == 6 * 200
    assert error_lines(text) == []
    assert_nothing_left(slurm_cluster, job)


def test_time_limit_warning_checkpoints_requeues_and_resumes(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    out, ck = work / "requeue.out", work / "requeue-ck"
    job = sbatch_template(slurm_cluster, PS_PER_NODE, ["-N3", "--cpus-per-task=2", "-o", str(out), "--open-mode=append"],
                          ["--checkpoint-every", "epoch", "fit.py", str(ck), "3", "200"], work)
    try:
        assert wait_for_text(out, "Epoch 1/3", TIMEOUT), out.read_text(errors="replace") if out.exists() else "no output"
        slurm_cluster.head(["scancel", "--signal=USR1", "--batch", str(job)], check=True, timeout=30)
        assert wait_for_text(out, "requeued job", 120), out.read_text(errors="replace")[-4000:]
        result = wait_through_requeue(slurm_cluster, job)
    finally:
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED", text[-4000:]
    saved = [line for line in text.splitlines() if "got SIGUSR1: saved a checkpoint at step" in line]
    assert len(saved) == 1, text[-4000:]
    step = int(saved[0].split("at step ")[1].split()[0])
    # "(scontrol requeue J)", or "(scontrol requeue J was ended by SIGTERM ...)" when Slurm
    # ends the step, scontrol among it, as it requeues the job (requeue.py): requeued both ways.
    assert f"(scontrol requeue {job}" in text, text[-4000:]
    assert f"resuming from {ck}/ckpt-{step:012d}" in text
    assert result_of(text)["step"] == 3 * 200
    assert_nothing_left(slurm_cluster, job)


def test_cut_link_names_the_node_requeues_and_resumes(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    """n3's link cut during training (a dead node to its peers: no socket closes): the first
    node's agent names n3 within the heartbeat timeout and requeues the job (the template
    passes --requeue); once the link is back the job runs again and resumes to the end."""
    out, ck = work / "cut.out", work / "cut-ck"
    job = sbatch_template(slurm_cluster, PS_PER_NODE, ["-N3", "--cpus-per-task=2", "-o", str(out), "--open-mode=append"],
                          ["--heartbeat-timeout", "10", "--checkpoint-every", "2s", "fit.py", str(ck), "3", "200"], work)
    cut = False
    try:
        assert wait_for_text(out, "Epoch 1/3", TIMEOUT), out.read_text(errors="replace") if out.exists() else "no output"
        deadline = time.monotonic() + TIMEOUT  # cut once a checkpoint exists: the rerun must resume from it
        while not any(ck.glob("ckpt-*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any(ck.glob("ckpt-*")), out.read_text(errors="replace")[-4000:]
        slurm_cluster.set_link("n3", up=False)
        cut = True
        assert wait_for_text(out, "lost the node n3", 60), out.read_text(errors="replace")[-4000:]
        assert wait_for_text(out, "requeued job", 60), out.read_text(errors="replace")[-4000:]
        slurm_cluster.set_link("n3", up=True)
        cut = False
        result = wait_through_requeue(slurm_cluster, job)
    finally:
        if cut:
            slurm_cluster.set_link("n3", up=True)
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED", text[-4000:]
    lost = [line for line in text.splitlines() if "lost the node n3: its agent sent no heartbeat for" in line]
    assert len(lost) == 1 and lost[0].startswith("[n1 agent]"), text[-4000:]
    # "(scontrol requeue J)", or "(scontrol requeue J was ended by SIGTERM ...)" when Slurm
    # ends the step, scontrol among it, as it requeues the job (requeue.py): requeued both ways.
    assert f"(scontrol requeue {job}" in text, text[-4000:]
    assert f"resuming from {ck}/ckpt-" in text, text[-4000:]
    assert result_of(text)["step"] == 3 * 200
    assert_nothing_left(slurm_cluster, job, wait=60)


def test_cut_link_without_requeue_ends_the_interactive_step(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    """Issue 24 §4: an interactive srun without --requeue. After n3's link is cut, the first
    node's agent names n3, stops the job and cancels the step (scancel JOB.STEP), so srun
    returns within a bounded time instead of waiting for Slurm to give n3 up (SlurmdTimeout,
    300 s by default, which this cluster keeps)."""
    out, ck = work / "cut-srun.out", work / "cut-srun-ck"
    argv = ["srun", "-N3", "--ntasks-per-node=1", "--cpus-per-task=2", "python", "-m", "keras_distrib.slurm",
            "--heartbeat-timeout", "10", "--checkpoint-every", "2s", "fit.py", str(ck), "3", "200"]
    with out.open("w") as sink:
        proc = slurm_cluster.popen("head", argv, cwd=work, stdout=sink, stderr=subprocess.STDOUT)
    cut, elapsed = False, None
    try:
        assert wait_for_text(out, "Epoch 1/3", TIMEOUT), out.read_text(errors="replace")[-4000:]
        slurm_cluster.set_link("n3", up=False)
        cut, started = True, time.monotonic()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        elapsed = time.monotonic() - started
    finally:
        if cut:
            slurm_cluster.set_link("n3", up=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text(errors="replace")
    assert proc.returncode not in (0, -signal.SIGKILL), f"srun still waiting {elapsed:.0f} s after the cut:\n{text[-4000:]}"
    lost = [line for line in text.splitlines() if "lost the node n3: its agent sent no heartbeat for" in line]
    assert len(lost) == 1 and lost[0].startswith("[n1 agent]"), text[-4000:]
    assert "ending the step (scancel " in text, text[-4000:]
    print(f"\nlink cut -> srun returned: {elapsed:.1f} s (heartbeat timeout 10 s, exit code {proc.returncode})")
    assert_nothing_left(slurm_cluster, wait=60)


def test_frozen_ps_on_another_node_is_named_and_restarted(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    """Issue 24 on the real cluster: ps:1 on n2 stopped with SIGSTOP (alive, sockets open,
    its agent still sending heartbeats) is named by n2's agent with its stacks, restarted with
    the chief's SCRIPT, and the job completes with the exact step count."""
    out, ck = work / "frozen.out", work / "frozen-ck"
    job = sbatch_template(slurm_cluster, PS_PER_NODE, ["-N2", "--cpus-per-task=2", "-o", str(out)],
                          ["--checkpoint-every", "2s", "--hang-timeout", "20", "fit.py", str(ck), "4", "200"], work)
    frozen = None
    try:
        assert wait_for_text(out, "Epoch 1/4", TIMEOUT), out.read_text(errors="replace") if out.exists() else "no output"
        deadline = time.monotonic() + TIMEOUT  # freeze once a checkpoint exists: the restart resumes from it
        while not any(ck.glob("ckpt-*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        frozen = pid_of(slurm_cluster, "n2", "ps:1")
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert wait_for_text(out, "ps:1 on n2 made no progress", 120), out.read_text(errors="replace")[-4000:]
        named_after = time.monotonic() - stopped_at
        result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED", text[-4000:]
    named = [line for line in text.splitlines() if "ps:1 on n2 made no progress for" in line]
    assert len(named) == 1 and "(state: stopped)" in named[0] and "stacks" in named[0], named
    assert "restarting it and the chief's SCRIPT, which resumes" in named[0], named[0]
    assert f"resuming from {ck}/ckpt-" in text, text[-4000:]
    assert result_of(text)["step"] == 4 * 200
    print(f"\nps:1 frozen -> named: {named_after:.1f} s (--hang-timeout 20)")
    assert_nothing_left(slurm_cluster, job, wait=60)
