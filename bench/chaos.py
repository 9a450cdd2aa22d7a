"""Faults in combination on the real Slurm test cluster: seeded schedules, many faults per job.

    python bench/chaos.py [--layouts ps-per-node,ps-jax,allreduce,jax] [--seeds 3 | --seed S]
                          [--faults 5] [--min-gap 5] [--span 90] [--reference ACC] [--prefix P] [--smoke]

``ps-jax`` is ps-per-node under ``KERAS_BACKEND=jax`` (the JAX ps trainer, the same fit.py).
For each layout: one undisturbed job (the accuracy to match), then one job per seed through
scripts/sbatch/elastic.sbatch on 3 nodes (--min-nodes 2 --requeue, heartbeat 10 s, hang
timeout 15 s, a checkpoint every 2 s), with `_faults.draw_schedule`'s faults injected after
the first checkpoint: kills of a worker, a ps or the chief, freezes, link cuts (back, or
until the job ends or requeues), an agent killed and a --join agent started, a preemption,
a kill as a checkpoint appears. The seed and the schedule are printed first; ``--seed S``
replays one. Each run ends with one summary line; it passes when the job ends by itself
with exit 0, the step counter is epochs x steps, each epoch (of every run of the job) that
began 30 s after every fault saw each example once, the accuracy is within one point of the
undisturbed run's, every fault but a freeze (a link cut) shorter than the hang (heartbeat)
timeout has a line that names it, and no process or port is left on any node. The last line is the tally.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _faults import Fault, describe, draw_schedule
from _harness import REPO, parser

sys.path.insert(0, str(REPO / "scripts" / "testcluster"))
sys.path.insert(0, str(REPO / "tests" / "slurm"))

NODES = ("n1", "n2", "n3")
HANG_TIMEOUT = 15.0
HEARTBEAT_TIMEOUT = 10.0
#: A link cut this long before the job stops (a requeue, its end) or its training ends may go
#: unnoticed: the agents stop before the heartbeat timeout (and a requeue brings the node back).
UNNOTICED_CUT = HEARTBEAT_TIMEOUT + 5.0
# --max-restarts 10: a schedule of 5 process faults must not spend the budget (3 by default;
# a spent budget ends the job by design, which is not what the harness is after).
OPTIONS = ["--heartbeat-timeout", str(int(HEARTBEAT_TIMEOUT)), "--hang-timeout", str(HANG_TIMEOUT), "--checkpoint-every", "2s",
           "--max-restarts", "10"]
#: The longest a job may stay RUNNING after its result line: the processes' shutdown, agent 0's
#: wait for the others to disconnect (13 s), a cut-off node's step ended and srun's return (not
#: the COMPLETING that follows while Slurm reaches a node that was cut off).
END_WAIT = 60.0
#: What names each kind of fault in the job's output (a regex, given the fault's node).
NAMED_BY = {
    "kill-worker": r"worker:\d+ on {node} exited with signal 9|lost (the node )?{node}",
    "kill-in-checkpoint": r"worker:\d+ on {node} exited with signal 9|lost (the node )?{node}",
    "kill-ps": r"ps:\d+ on {node} exited with signal 9|lost (the node )?{node}",
    "kill-chief": r"chief:0 on {node} (exited|finished|exited unexpectedly) with signal 9",
    # all-reduce: the frozen worker's peers fail first and name it ("stopped sending heartbeats")
    "freeze": r"on {node} made no progress|on {node} stopped sending heartbeats|lost (the node )?{node}",
    "cut-link": r"lost (the node )?{node}|lost contact with the first node's agent|{node} did not acknowledge the end",
    "cut-link-for-good": r"lost (the node )?{node}|lost contact with the first node's agent|{node} did not acknowledge the end",
    "kill-agent": r"lost (the node )?{node}|the agent on {node} disconnected unexpectedly",
    "preempt": r"requeued job|checkpoint.*(preempt|SIGUSR1|time limit)|got a time-limit or preemption warning",
}


#: The harness's layout names that are another layout on another Keras backend: (layout, backend).
ON_BACKEND = {"ps-jax": ("ps-per-node", "jax")}


def launcher_layout(layout: str) -> str:
    """The --layout a harness layout runs with."""
    return ON_BACKEND.get(layout, (layout, ""))[0]


def job_env(layout: str) -> dict[str, str]:
    """The environment of a harness layout's job (sbatch exports it to the tasks)."""
    env = {"LAYOUT": launcher_layout(layout), "JAX_PLATFORMS": "cpu"}
    if layout in ON_BACKEND:
        env["KERAS_BACKEND"] = ON_BACKEND[layout][1]
    return env


def runs_script(layout: str, task: str) -> bool:
    """Whether ``task`` runs SCRIPT (else it is a TF server): every process in allreduce and
    jax, the chief and the workers on the JAX ps trainer, the chief alone on the TF one."""
    return task == "chief:0" or layout in ("allreduce", "jax") or (layout in ON_BACKEND and not task.startswith("ps:"))


@dataclass
class Run:
    """One job under one schedule, and what it showed."""

    layout: str
    seed: int
    faults: list[Fault]
    epochs: int
    injected: dict[int, str] = field(default_factory=dict)  # by the fault's index in ``faults``
    cut_at: dict[int, float] = field(default_factory=dict)  # when each link cut began (time.monotonic)
    struck: dict[int, float] = field(default_factory=dict)  # when each fault was done (time.time, as the epochs' stamps)
    problems: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)


def task_pid(cluster, node: str, task: str, script: bool) -> int | None:
    """The pid of ``task`` (``worker:1``) on ``node`` (its SCRIPT, or its TF server); None: not running."""
    from test_launcher_slurm import pid_of

    try:
        return pid_of(cluster, node, task, timeout=2, command=r"fit(_jax)?\.py" if script else r"-m keras_distrib\.servers")
    except AssertionError:
        return None


def agent_pid(cluster, node: str) -> int | None:
    netns = os.stat(f"/run/netns/{cluster.prefix}-{node}").st_ino
    for entry in cluster.processes_matching(r"-m keras_distrib\.slurm"):
        pid = int(entry.split()[0])
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == netns:
                return pid
        except OSError:
            continue
    return None


def victim(cluster, layout: str, fault: Fault) -> tuple[str, int | None]:
    """The task a kill or freeze on ``fault.node`` hits, and its pid (None: not running now)."""
    index = NODES.index(fault.node)
    if fault.kind == "kill-chief":
        task = "chief:0" if layout not in ("allreduce", "jax") else "worker:0"
    elif fault.kind == "kill-ps":
        task = f"ps:{index}"
    else:
        task = f"worker:{index}"
    return task, task_pid(cluster, fault.node, task, runs_script(layout, task))


def inject(cluster, run: Run, index: int, job: int, work: Path, ck: Path, cut: dict[str, tuple[int, float]]) -> None:
    """Do fault ``index`` of the run's schedule now; record what was done in ``run.injected``
    (``cut``: the nodes whose link is down, with the fault's index and when it was cut)."""
    fault = run.faults[index]
    kind, node = fault.kind, fault.node
    if kind in ("cut-link", "cut-link-for-good"):
        run.injected[index] = f"{kind} {node}"
        run.struck[index] = time.time()
        cluster.set_link(node, up=False)
        run.cut_at[index] = time.monotonic()
        cut[node] = (index, run.cut_at[index])
        if kind == "cut-link":
            time.sleep(fault.seconds)
            if node in cut:  # not brought back meanwhile by a requeue
                cluster.set_link(node, up=True)
                cut.pop(node, None)
        return
    if kind == "preempt":
        run.struck[index] = time.time()
        cluster.head(["scancel", "--batch", "--signal=USR1", str(job)], timeout=30)
        run.injected[index] = f"preempt job {job}"
        return
    if kind == "kill-agent":
        pid = agent_pid(cluster, node)
        if pid is None:
            run.injected[index] = f"kill-agent {node}: no agent there (skipped)"
            return
        run.struck[index] = time.time()
        os.kill(pid, signal.SIGKILL)
        argv = ["srun", f"--jobid={job}", "-N1", "-w", node, "--overlap", "python", "-m", "keras_distrib.slurm",
                "--join", "--layout", launcher_layout(run.layout), "--min-nodes", "2", "--requeue", *OPTIONS,
                *script_args(run, ck)]
        with (work / f"join-{run.seed}-{node}.out").open("a") as sink:
            cluster.popen("head", argv, env=job_env(run.layout), cwd=work, stdout=sink, stderr=subprocess.STDOUT)
        run.injected[index] = f"kill-agent {node} (pid {pid}), --join agent started"
        return
    if kind == "kill-in-checkpoint":
        before = newest_file(ck)
        deadline = time.monotonic() + 30
        while newest_file(ck) <= before and time.monotonic() < deadline:
            time.sleep(0.01)
    task, pid = victim(cluster, run.layout, fault)
    if pid is None:
        run.injected[index] = f"{kind} {task} on {node}: not running (skipped)"
        return
    run.injected[index] = f"{kind} {task} on {node} (pid {pid})"
    run.struck[index] = time.time()
    try:
        os.kill(pid, signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
        if kind == "freeze":
            gone = seconds_until_gone(pid, fault.seconds)
            if gone is None:
                os.kill(pid, signal.SIGCONT)
            elif gone < HANG_TIMEOUT:  # a restart for another fault replaced it: the watchdog had no time
                run.injected[index] += f" (replaced {gone:.0f} s later, before the hang timeout: may go unnoticed)"
    except ProcessLookupError:  # gone meanwhile (the watchdog restarts a process frozen past its timeout)
        pass


def seconds_until_gone(pid: int, seconds: float) -> float | None:
    """Watch ``pid`` for ``seconds``: how long until it was gone (a zombie counts), None if it stayed."""
    started = time.monotonic()
    while (waited := time.monotonic() - started) < seconds:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return waited
        if state in ("Z", "X"):
            return waited
        time.sleep(0.2)
    return None


def newest_file(directory: Path) -> float:
    """The latest modification time of a file under ``directory`` (0: none): it grows as a checkpoint is written."""
    times = []
    for path in directory.rglob("*"):
        try:
            times.append(path.stat().st_mtime)
        except OSError:  # replaced as it was read
            continue
    return max(times, default=0.0)


def script_args(run: Run, ck: Path) -> list[str]:
    if run.layout == "jax":
        return ["fit_jax.py", str(ck), str(run.epochs)]
    return ["fit.py", str(ck), str(run.epochs), "0", str(EXAMPLES), str(BATCH)]


#: fit.py's epochs are one pass over EXAMPLES rows in batches of BATCH: STEPS steps on 2 workers
#: as on 3 (a ps layout's shards of 1/k of the rows, all-reduce's global batch of BATCH/k per
#: worker), so the step count is the same whichever nodes a recovery leaves.
EXAMPLES, BATCH = 9216, 48
STEPS = EXAMPLES // BATCH
#: An epoch that began this long after a fault ended (a freeze's SIGCONT, a link's return; a kill
#: or a preemption ends at once) must have seen each example once: its recovery is over.
RECOVERED_AFTER = 30.0


def job_fields(cluster, job: int) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, ExitCode=a:b, ...)."""
    return dict(re.findall(r"(\w+)=(\S*)", cluster.head(["scontrol", "-o", "show", "job", str(job)], timeout=30).stdout))


def job_state(cluster, job: int) -> str:
    return job_fields(cluster, job).get("JobState", "UNKNOWN")


class OutputWatch:
    """When marked lines appear in a job's output (monotonic times), reading only what is new."""

    MARKS = {"trained": b'] {"step":', "requeued": b"requeued job"}

    def __init__(self, out: Path) -> None:
        self.out = out
        self.read = 0
        self.seen: dict[str, list[float]] = {name: [] for name in self.MARKS}

    def poll(self) -> None:
        if not self.out.is_file():
            return
        start = max(0, self.read - 64)  # a mark may straddle two reads
        with self.out.open("rb") as f:
            f.seek(start)
            new = f.read()
        for name, mark in self.MARKS.items():
            fresh = sum(1 for m in re.finditer(re.escape(mark), new) if start + m.end() > self.read)
            self.seen[name] += [time.monotonic()] * fresh
        self.read = start + len(new)


def run_job(cluster, work: Path, run: Run, timeout: float) -> tuple[str, str]:
    """Submit, inject the schedule after the first checkpoint, wait for the end; (final state, output)."""
    import threading

    name = f"{run.layout}-{run.seed}"
    out, ck = work / f"{name}.out", work / f"{name}-ck"
    argv = ["sbatch", "--parsable", "-N3", "--cpus-per-task=2", "-o", str(out), "--open-mode=append",
            str(REPO / "scripts" / "sbatch" / "elastic.sbatch"), *OPTIONS, *script_args(run, ck)]
    job = int(cluster.head(argv, env=job_env(run.layout), cwd=work, check=True, timeout=60).stdout.split(";")[0])
    saved = {"jax": "training_metadata.json", "ps-jax": "jax-ps/epoch.json"}.get(run.layout, "ckpt-*")
    cut: dict[str, tuple[int, float]] = {}
    watch = OutputWatch(out)
    deadline = time.monotonic() + timeout
    ended_at: float | None = None  # when the batch script was done, after the training
    threads = []
    try:
        while not any(ck.glob(saved)) and time.monotonic() < deadline:
            time.sleep(0.2)
        start = time.monotonic()

        def watch_until(moment: float) -> None:
            """Sleep until ``moment``, noting when marked lines appear in the job's output."""
            while True:
                watch.poll()
                if time.monotonic() >= moment:
                    return
                time.sleep(min(0.5, max(0.0, moment - time.monotonic())))

        for index, fault in enumerate(run.faults):
            watch_until(start + fault.at)
            if job_state(cluster, job) not in ("RUNNING",):
                run.injected[index] = f"{fault.kind} on {fault.node}: the job was not running (skipped)"
                continue
            print(f"  fault at {time.monotonic() - start:6.1f} s: {fault.kind} on {fault.node}", file=sys.stderr, flush=True)
            thread = threading.Thread(target=inject, args=(cluster, run, index, job, work, ck, cut), daemon=True)
            thread.start()
            threads.append(thread)
        state = job_state(cluster, job)
        while time.monotonic() < deadline:
            state = job_state(cluster, job)
            watch_until(0.0)
            if state != "RUNNING" and cut:
                for node in list(cut):  # a requeued (or ending) job waits for its nodes: bring them back
                    cluster.set_link(node, up=True)
                    index, when = cut.pop(node)
                    if time.monotonic() - when < UNNOTICED_CUT:
                        run.injected[index] += (f" (the job stopped {time.monotonic() - when:.0f} s later, {state}: "
                                                "may go unnoticed)")
            if state != "RUNNING" and watch.seen["trained"] and ended_at is None:
                ended_at = time.monotonic()  # the batch script is done (what the user waits for)
            if state not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING", "REQUEUE_HOLD", "SUSPENDED"):
                break
            time.sleep(0.5)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        for node in list(cut):
            cluster.set_link(node, up=True)
        cluster.head(["scancel", str(job)], timeout=30)
    if watch.seen["trained"]:
        run.result["ended_after_training"] = round((ended_at or deadline) - watch.seen["trained"][0], 1)
    for index, when in run.cut_at.items():
        # The job's stop (training's end, a requeue) overtook the cut: its agents stop (or are
        # cancelled) before the heartbeat timeout, and a requeue brings the node back.
        for what, times in (("training ended", watch.seen["trained"][:1]), ("the job requeued", watch.seen["requeued"])):
            near = [t for t in times if abs(t - when) < UNNOTICED_CUT]
            if near and "unnoticed" not in run.injected[index]:
                run.injected[index] += f" ({what} {near[0] - when:.0f} s later: may go unnoticed)"
    run.result["job"], run.result["checkpoints"] = job, str(ck)
    return state, out.read_text(errors="replace")


def shorter_than_its_timeout(fault: Fault) -> bool:
    """A freeze shorter than the hang timeout, or a link cut shorter than the heartbeat timeout,
    may pass unnoticed (the job waits it out): no line needs to name it."""
    timeout = {"freeze": HANG_TIMEOUT, "cut-link": HEARTBEAT_TIMEOUT}.get(fault.kind)
    return timeout is not None and fault.seconds < timeout + 5


def check(cluster, run: Run, state: str, text: str, reference: float | None, exit_code: int | None) -> None:
    """What every run must show; problems go to ``run.problems``."""
    from test_elastic_slurm import JAX_STEPS, final_row
    from test_launcher_slurm import error_lines

    if state != "COMPLETED" or exit_code:
        run.problems.append(f"the job ended {state} (exit code {exit_code})")
    try:
        row = final_row(text)
    except AssertionError:
        row = {}
        run.problems.append("no result line from the first node")
    run.result.update(row)
    steps = run.epochs * (JAX_STEPS if run.layout == "jax" else STEPS)
    if row and row.get("step") != steps:
        run.problems.append(f"step counter {row.get('step')}, not {steps}")
    if row and reference is not None and row.get("accuracy", 0.0) < reference - 0.01:
        run.problems.append(f"accuracy {row.get('accuracy'):.3f}, more than a point under {reference:.3f}")
    run.problems += epoch_problems(run, epoch_records(text))
    for index, fault in enumerate(run.faults):
        done = run.injected.get(index, "skipped: never injected")
        if "skipped" in done or "unnoticed" in done or shorter_than_its_timeout(fault):
            continue
        if not re.search(NAMED_BY[fault.kind].format(node=fault.node), text):
            run.problems.append(f"no line names {fault.kind} on {fault.node}")
    if run.result.get("ended_after_training", 0.0) > END_WAIT:
        run.problems.append(f"the job ran {run.result['ended_after_training']:.0f} s after its training (more than "
                            f"{END_WAIT:.0f} s: waited for a node?)")
    run.problems += checkpoint_problems(run.result.get("checkpoints"))
    procs, ports = cluster.leftovers(r"keras_distrib|fit\.py|fit_jax\.py", 60)
    if procs or any(ports.values()):
        run.problems.append(f"left running: {procs} {ports}")
    run.result["errors"] = len(error_lines(text))
    # Not a failure when the job recovered, but kept: the stacks of a crash inside TensorFlow.
    run.result["crashes"] = re.findall(r"Fatal Python error: ([\w ]+)", text)


def epoch_records(text: str) -> list[list[float]]:
    """The ``epoch-record [epoch, start, end, seen, pid]`` lines of the first node's chief (its
    worker 0 where there is no chief): every epoch each run of the job trained, in order."""
    lines = re.findall(r"^\[n1 ([\w-]+:\d+)\] epoch-record (\[.*\])\s*$", text, re.M)
    chief = any(label.startswith("chief") for label, _ in lines)
    return [json.loads(row) for label, row in lines if label.startswith("chief") or not chief]


def epoch_problems(run: Run, records: list[list[float]]) -> list[str]:
    """Each epoch any run of the job trained that began RECOVERED_AFTER past every fault (or
    ended before it) saw each example once (its ``seen`` metric is the data's size); the first
    epoch of a run that resumed is partial. Counts the epochs checked in ``run.result["exact_epochs"]``."""
    from test_elastic_slurm import JAX_EXAMPLES

    examples = JAX_EXAMPLES if run.layout == "jax" else EXAMPLES
    busy = [(at, at + run.faults[index].seconds + RECOVERED_AFTER) for index, at in run.struck.items()]
    problems, checked, runs = [], 0, set()
    for epoch, began, ended, seen, pid in records:
        resumed = pid not in runs and epoch > 0
        runs.add(pid)
        if resumed or any(began < until and ended > at for at, until in busy):
            continue
        checked += 1
        if seen != examples:
            problems.append(f"epoch {epoch + 1} (pid {pid}) saw {seen:.0f} examples, not {examples}")
    run.result["exact_epochs"] = f"{checked} of {len(records)}"
    return problems


def checkpoint_problems(directory: str | None) -> list[str]:
    """A checkpoint directory after the job: every ``ckpt-*`` readable (its meta.json and TF
    index), their steps increasing with their names; a jax run's Keras backup readable JSON;
    the JAX ps trainer's epoch.json readable JSON beside its weights."""
    from keras_distrib.checkpoints import CheckpointStore

    if not directory or not Path(directory).is_dir():
        return []
    ck = Path(directory)
    problems = []
    named = sorted(p.name for p in ck.glob("ckpt-*"))
    readable = CheckpointStore(ck, writer=False).complete()
    if len(readable) != len(named):
        problems.append(f"checkpoints without readable meta.json: {sorted(set(named) - {p.name for p, _ in readable})}")
    problems += [f"{path.name} has no TF checkpoint index" for path, _ in readable if not any(path.rglob("*.index"))]
    for record in ck.rglob("epoch.json"):
        try:
            json.loads(record.read_text())
        except ValueError:
            problems.append(f"{record} is not JSON")
        if not (record.parent / "model.weights.h5").is_file():
            problems.append(f"{record} has no model.weights.h5 beside it")
    for backup in ck.rglob("training_metadata.json"):
        try:
            json.loads(backup.read_text())
        except ValueError:
            problems.append(f"{backup} is not JSON")
    return problems


def exit_code_of(cluster, job: int) -> int | None:
    code = job_fields(cluster, job).get("ExitCode", "").partition(":")[0]
    return int(code) if code.isdigit() else None


def chaos_runs(cluster, work: Path, layout: str, seeds: list[int], count: int, *, span: float, min_gap: float,
               epochs: int, out: Path, reference: float | None = None) -> list[Run]:
    """One job per seed, after one undisturbed job of ``layout`` whose accuracy they must
    match (``reference`` given: that one instead); the schedule and a summary line of each
    printed, the output of a failed one kept in ``out``."""
    from test_elastic_slurm import FIT, JAX_FIT

    (work / "fit.py").write_text(FIT)
    (work / "fit_jax.py").write_text(JAX_FIT)
    if reference is None:
        undisturbed = Run(layout, 0, [], epochs)
        state, text = run_job(cluster, work, undisturbed, 900)
        check(cluster, undisturbed, state, text, None, exit_code_of(cluster, undisturbed.result["job"]))
        reference = undisturbed.result.get("accuracy")
        print(f"{layout} undisturbed: {state}, accuracy {reference}, epochs checked whole "
              f"{undisturbed.result.get('exact_epochs')}: {'; '.join(undisturbed.problems) or 'ok'}", flush=True)
    runs = []
    for seed in seeds:
        faults = draw_schedule(seed, count, layout=layout, nodes=NODES, span=span, min_gap=min_gap)
        print(describe(seed, layout, faults), flush=True)
        run = Run(layout, seed, faults, epochs)
        state, text = run_job(cluster, work, run, 1500)
        check(cluster, run, state, text, reference, exit_code_of(cluster, run.result["job"]))
        runs.append(run)
        for index in sorted(run.injected):
            print(f"  injected: {run.injected[index]}", flush=True)
        verdict = "ok" if not run.problems else "FAILED: " + "; ".join(run.problems)
        crashes = run.result.get("crashes")
        print(f"seed {seed} {layout}: {len(faults)} faults, step {run.result.get('step')}, accuracy "
              f"{run.result.get('accuracy')}, epochs checked whole {run.result.get('exact_epochs')}{f', crashes {crashes}' if crashes else ''}: {verdict}", flush=True)
        if run.problems or crashes:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"chaos-{layout}-{seed}.out").write_text(text)
    return runs


def tally(runs: list[Run]) -> str:
    """``chaos: 3 run(s), 14 fault(s) injected (freeze 3, ...), 1 failed (seeds ps-per-node:12)``."""
    kinds: dict[str, int] = {}
    for run in runs:
        for done in run.injected.values():
            if "skipped" not in done:
                kinds[done.split()[0]] = kinds.get(done.split()[0], 0) + 1
    failed = [r for r in runs if r.problems]
    return (f"chaos: {len(runs)} run(s), {sum(kinds.values())} fault(s) injected "
            f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), {len(failed)} failed"
            + (f" (seeds {', '.join(f'{r.layout}:{r.seed}' for r in failed)})" if failed else ""))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--layouts", default="ps-per-node,ps-jax,allreduce,jax")
    p.add_argument("--seeds", type=int, default=3, help="seeds per layout, from a random base (default 3)")
    p.add_argument("--seed", type=int, default=None, help="replay this one seed")
    p.add_argument("--faults", type=int, default=5)
    p.add_argument("--min-gap", type=float, default=5.0, help="seconds between two faults (0: during a recovery)")
    p.add_argument("--span", type=float, default=60.0, help="seconds the faults spread over")
    p.add_argument("--epochs", type=int, default=40, help="epochs of 192 steps (jax: of 60): longer than the faults")
    p.add_argument("--reference", type=float, default=None,
                   help="the undisturbed accuracy to match (default: one undisturbed job per layout measures it)")
    p.add_argument("--prefix", default="kdchaos", help="the test cluster's name prefix (two runs at once need two)")
    args = p.parse_args()
    from slurm_cluster import SlurmTestCluster

    # A SIGTERM (a timeout, kill) unwinds like Ctrl-C: the test cluster is stopped, not left running.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))

    ok, why = SlurmTestCluster.available()
    if not ok:
        sys.exit(f"bench/chaos.py needs the real Slurm test cluster: {why}")
    base = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")
    seeds = [base] if args.seed is not None else [base + i for i in range(1 if args.smoke else args.seeds)]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp, \
            SlurmTestCluster(Path(tmp) / "cluster", prefix=args.prefix) as cluster:
        work = Path(tmp) / "work"
        work.mkdir()
        for layout in args.layouts.split(","):
            runs += chaos_runs(cluster, work, layout, seeds, 2 if args.smoke else args.faults, span=args.span,
                               min_gap=args.min_gap, epochs=args.epochs, out=args.out, reference=args.reference)
    print(tally(runs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(
        [{"layout": r.layout, "seed": r.seed, "faults": [f.describe() for f in r.faults], "injected": list(r.injected.values()),
          "problems": r.problems, "result": r.result} for r in runs], indent=2))


if __name__ == "__main__":
    main()
