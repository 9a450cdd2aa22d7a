"""The hang watchdog's policy with a fake clock and fake processes, and the agent's decisions on it.

No TF process: ``Watch`` is fed samples (state letter, progress counter) at chosen times;
the agent is the lifecycle test's harness, fed ``Hung`` events and ``Stuck`` reports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from keras_distrib import contract, progress
from keras_distrib.launcher.messages import FromPeer, Hung, Restart, Stuck, decode, to_wire
from keras_distrib.launcher.options import Options, validate
from keras_distrib.launcher.watchdog import (
    Sample, Watch, blamed_peers, dump_stacks, poll_interval, proc_state, stacks_file,
)
from test_agent_lifecycle import harness, lines  # noqa: F401 - the fixture is used by name

pytestmark = pytest.mark.unit

H = 120.0


def run(watch: Watch, timeline: list[tuple[float, dict[str, Sample]]]) -> list[tuple[float, Any]]:
    """Feed ``timeline`` (time, samples) to ``watch``; the verdicts with their times."""
    return [(now, v) for now, samples in timeline if (v := watch.observe(now, samples)) is not None]


def every(poll: float, until: float, make: Any) -> list[tuple[float, dict[str, Sample]]]:
    steps = int(until / poll) + 1
    return [(i * poll, make(i * poll)) for i in range(steps)]


# -- Watch: when ---------------------------------------------------------------------------


def test_a_healthy_job_is_never_named() -> None:
    # A chief counting every 2 s, with a 100 s checkpoint pause at 500 s; servers sleeping.
    def sample(t: float) -> dict[str, Sample]:
        count = int(min(t, 500) / 2) + int(max(0.0, t - 600) / 2)
        return {"chief:0": Sample("S", count, True), "ps:0": Sample("S"), "worker:0": Sample("R")}

    assert run(Watch(H, 5), every(5, 3000, sample)) == []


def test_silence_outside_fit_is_not_judged() -> None:
    # fit ends at 300 s; SCRIPT then exports for 1000 s; a second fit starts at 1300 s,
    # compiles for 200 s and counts again.
    def sample(t: float) -> dict[str, Sample]:
        busy = t < 300 or t >= 1300
        count = int(min(t, 300) / 2) + (int((t - 1500) / 2) if t >= 1500 else 0)
        return {"chief:0": Sample("S", count + 1, True, busy)}

    assert run(Watch(H, 5), every(5, 2000, sample)) == []


def test_the_first_count_arms_the_watch() -> None:
    # Start-up and the first step's compilation take 400 s: no count yet, no verdict.
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", None if t < 100 else (0 if t < 400 else 1 + int((t - 400) / 2)), True)}

    assert run(Watch(H, 5), every(5, 1000, sample)) == []


def test_a_silent_script_is_named_after_the_timeout() -> None:
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", int(min(t, 300) / 2) + 1, True), "ps:0": Sample("S")}

    verdicts = run(Watch(H, 5), every(5, 1000, sample))
    assert len(verdicts) == 1  # named once, not again every round
    when, verdict = verdicts[0]
    assert verdict.key == "chief:0" and not verdict.stopped and verdict.state == "S"
    assert 300 + H <= when <= 300 + H + 5 and verdict.seconds >= H


def test_the_limit_grows_with_the_longest_healthy_gap() -> None:
    # Chunks of 100 s (slow steps): 120 s of silence is normal; 3 x 100 s is the limit.
    def sample(t: float) -> dict[str, Sample]:
        return {"worker:0": Sample("S", int(min(t, 1000) / 100) + 1, True)}

    verdicts = run(Watch(H, 5), every(5, 2000, sample))
    assert [round(w) for w, _ in verdicts] == [1300]


@pytest.mark.parametrize(("letter", "stopped_at"), [("T", 200.0), ("t", 350.0), ("D", 200.0)])
def test_a_frozen_server_is_named_even_while_the_chief_still_counts(letter: str, stopped_at: float) -> None:
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", int(t / 2) + 1, True), "ps:1": Sample(letter if t >= stopped_at else "S")}

    (when, verdict), = run(Watch(H, 5), every(5, 1000, sample))
    assert verdict.key == "ps:1" and verdict.stopped and verdict.state == letter
    assert stopped_at + H <= when <= stopped_at + H + 5


def test_the_frozen_process_is_named_not_the_chief_it_silenced() -> None:
    # The chief counted last at 298 s; worker:1 stopped at 300 s: the chief's silence is
    # due first, but the stopped worker is the cause.
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", int(min(t, 298) / 2) + 1, True), "worker:0": Sample("S"),
                "worker:1": Sample("T" if t >= 300 else "S")}

    (_, verdict), = run(Watch(H, 2), every(2, 1000, sample))
    assert verdict.key == "worker:1" and verdict.stopped and "chief:0" in verdict.others


@pytest.mark.parametrize("stop_after", [2, 6, 10])
def test_a_stopped_script_is_named_with_its_whole_silence(stop_after: float) -> None:
    # worker:1 counted last at 300 s and was seen stopped stop_after s later: its silence (the
    # counter) is due before its stop is, and the line gives the silence, not the stop's age.
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", int(t / 2) + 1, True),
                "worker:1": Sample("T" if t >= 300 + stop_after else "S", int(min(t, 300) / 2) + 1, True)}

    (when, verdict), = run(Watch(H, 2), every(2, 1000, sample))
    assert verdict.key == "worker:1" and verdict.stopped
    assert when == 300 + H and verdict.seconds == H


def test_the_scripts_a_frozen_process_silenced_get_a_new_clock_when_it_is_named() -> None:
    # worker:1 stopped at 300 s; the chief counted last at 310 s (a closure on worker:0), and
    # waits for worker:1's restart: it counts again 30 s after worker:1 was named and
    # replaced (a new pid), and is not named for that wait.
    def sample(t: float) -> dict[str, Sample]:
        chief = Sample("S", int(min(t, 310) / 2) + 1 if t < 450 else int(t / 2), True)
        worker = {("worker:1", 1): Sample("T" if t >= 300 else "S")} if t < 425 else {("worker:1", 2): Sample("S")}
        return {"chief:0": chief, "worker:0": Sample("S"), **worker}

    verdicts = run(Watch(H, 5), every(5, 1000, sample))
    assert [(v.key, v.others) for _, v in verdicts] == [(("worker:1", 1), ())]


def test_stopped_before_blocked_and_the_longest_first() -> None:
    def sample(t: float) -> dict[str, Sample]:
        return {"ps:0": Sample("D" if t >= 10 else "S"), "ps:1": Sample("T" if t >= 50 else "S"),
                "ps:2": Sample("T" if t >= 60 else "S")}

    (_, verdict), = run(Watch(H, 5), every(5, 400, sample))
    assert verdict.key == "ps:1" and set(verdict.others) == {"ps:0", "ps:2"}


def test_a_stop_shorter_than_the_timeout_is_forgiven() -> None:
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", int(t / 2) + 1, True), "ps:0": Sample("T" if 100 <= t < 200 else "S")}

    assert run(Watch(H, 5), every(5, 1000, sample)) == []


def test_the_whole_job_suspended_is_no_evidence() -> None:
    # scontrol suspend stops every process, the agent too: it resumes 1000 s later.
    timeline = [(t, {"chief:0": Sample("S", int(t / 2) + 1, True), "ps:0": Sample("S")}) for t in range(0, 300, 5)]
    timeline += [(1300.0 + t, {"chief:0": Sample("S", 151 + int(t / 2), True), "ps:0": Sample("S")})
                 for t in range(0, 300, 5)]
    assert run(Watch(H, 5), timeline) == []


def test_across_nodes_a_silent_script_waits_the_margin() -> None:
    def sample(t: float) -> dict[str, Sample]:
        return {"chief:0": Sample("S", int(min(t, 100) / 2) + 1, True)}

    (when, _), = run(Watch(H, 5, margin=15), every(5, 1000, sample))
    assert when >= 100 + H + 15 + 2  # + the longest gap seen (a chunk in flight at the freeze)


def test_a_restarted_process_is_watched_anew() -> None:
    watch = Watch(H, 5)
    seen = [t for t in range(0, 120 * 3, 5) if watch.observe(t, {("a", 1 if t < 200 else 2): Sample("T")})]
    assert seen == [120, 320]  # its successor (a new pid) is watched on a new clock


def test_poll_interval_bounds() -> None:
    assert poll_interval(300) == 5 and poll_interval(20) == 2 and poll_interval(1) == 0.5


# -- evidence -------------------------------------------------------------------------------


UNHEALTHY = (b"tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: "
             b"The following tasks are unhealthy (stopped sending heartbeats):\n")


@pytest.mark.parametrize(("lines_", "expected"), [
    ([UNHEALTHY.rstrip(b"\n") + b" /job:worker/replica:0/task:1\n"], ["worker:1"]),
    ([b"E1125 ... The following tasks are unhealthy (stopped sending heartbeats): /job:worker/task:2, "
      b"/job:worker/task:0\n"], ["worker:2", "worker:0"]),
    ([UNHEALTHY, b"/job:worker/task:1\n", b"/job:ps/task:0 is fine\n"], ["worker:1"]),  # the list on the next line
    ([b"tasks are unhealthy (stopped sending heartbeats): /job:jax_worker/replica:0/task:3\n"], ["jax_worker:3"]),
    ([b"ValueError: bad input\n"], []),
    # TF 2.21's own lines (a SIGSTOPped all-reduce worker:1, seen in worker:0's log)
    ([b"Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy "
      b"(stopped sending heartbeats):\n", b"/job:worker/replica:0/task:1\n",
      b"The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, "
      b"eviction) to debug further.\n", b"\t [[{{node while/sgd/CollectiveReduceV2}}]] [Op:__inference_run_chunk_737]\n"],
     ["worker:1"]),
])
def test_blamed_peers(lines_: list[bytes], expected: list[str]) -> None:
    assert blamed_peers(lines_) == expected


def test_stacks_of_a_stopped_process_are_kept(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_state(child.pid) == "T"
        path = stacks_file(tmp_path / "logs", "ps:1")
        how = dump_stacks(child.pid, path, "ps:1 on n2 made no progress for 120 s (state: stopped)")
        text = path.read_text()
        assert path.name == "ps-1.stacks.txt" and "ps:1 on n2 made no progress" in text
        assert f"thread {child.pid} " in text and "stopped" in text  # /proc, always
        if how == "py-spy":  # frames when py-spy is installed
            assert "<module>" in text and "Thread" in text
        assert proc_state(child.pid) == "T"  # reading it did not let it run
    finally:
        child.kill()
        child.wait()
    assert proc_state(child.pid) is None


def test_progress_counter_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress-worker-0"
    monkeypatch.delenv(contract.PROGRESS_FILE_VAR, raising=False)
    progress.reset()
    progress.tick()  # outside a job: nothing
    assert progress.read(path) is None
    monkeypatch.setenv(contract.PROGRESS_FILE_VAR, str(path))
    progress.tick()  # read once per process
    progress.reset()
    progress.tick()
    progress.tick(4)
    assert progress.read(path) == (5, False)

    @progress.watched
    def fit(fail: bool) -> None:
        progress.tick()
        assert progress.read(path) == (7 if fail else 6, True)
        if fail:
            raise RuntimeError

    fit(False)
    assert progress.read(path) == (6, False)
    with pytest.raises(RuntimeError):
        fit(True)
    assert progress.read(path) == (7, False)
    monkeypatch.setenv(contract.PROGRESS_FILE_VAR, "")
    progress.reset()
    progress.tick()
    assert progress.read(path) == (7, False)
    progress.reset()


# -- options ---------------------------------------------------------------------------------


def test_hang_timeout_option() -> None:
    assert Options().hang_timeout == 300
    assert validate(Options(hang_timeout=0)).hang_timeout == 0
    with pytest.raises(Exception, match="hang-timeout=-1 must be a number of seconds >= 0"):
        validate(Options(hang_timeout=-1))


# -- the agent's decisions ------------------------------------------------------------------


def hung(h: Any, name: str, seconds: float = 120, state: str = "stopped") -> None:
    h.agent.handle(Hung(h.processes.named(name), seconds, state, f"/logs/{name.replace(':', '-')}.stacks.txt"))


def test_a_stuck_ps_is_named_and_restarted_as_a_dead_one(lines: list[str]) -> None:
    h = harness(agent_id=0, max_restarts=2)
    hung(h, "ps:0")
    assert h.processes.restarted == [["ps:0", "chief:0"]] and h.agent.restarts.used == 1
    assert h.channel.to_all_sent == [Restart(("ps:0", "chief:0"))]
    assert ("ps:0 on n1 made no progress for 120 s (state: stopped); its Python stacks: /logs/ps-0.stacks.txt; "
            "restarting it and the chief's SCRIPT, which resumes from its last checkpoint (1/2)") in lines


def test_a_stuck_worker_elsewhere_is_reported_to_agent_0() -> None:
    h = harness(agent_id=1, max_restarts=2)
    hung(h, "worker:1")
    assert h.channel.to_leader_sent == [
        Stuck("worker:1", "worker:1 on n2", "made no progress for 120 s (state: stopped); its Python stacks: "
              "/logs/worker-1.stacks.txt", 0)]
    assert h.processes.restarted == []  # agent 0 orders it


def test_agent_0_restarts_all_reduce_workers_for_a_stuck_one_and_drops_stale_reports() -> None:
    h = harness("allreduce", agent_id=0, max_restarts=3)
    h.agent.handle(FromPeer(1, Stuck("worker:1", "worker:1 on n2", "made no progress for 120 s (state: stopped)", 0)))
    assert h.channel.to_all_sent == [Restart(("worker:0", "worker:1", "worker:2"))]
    # worker:2's agent saw its worker silent too and reported before the restart reached it
    h.agent.handle(FromPeer(2, Stuck("worker:2", "worker:2 on n3", "made no progress for 121 s (state: sleeping)", 0)))
    assert h.agent.restarts.used == 1
    h.agent.handle(FromPeer(2, Stuck("worker:2", "worker:2 on n3", "made no progress for 130 s (state: stopped)", 1)))
    assert h.agent.restarts.used == 2


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_stuck_process_without_restarts_left_fails_the_job_naming_it(max_restarts: int, lines: list[str]) -> None:
    h = harness(max_restarts=max_restarts)
    if max_restarts:
        hung(h, "worker:0")
    hung(h, "ps:0", 300)
    assert h.agent.result is not None and h.agent.result.code == 1
    assert "ps:0 on n1 made no progress for 300 s (state: stopped)" in h.agent.result.reason
    assert ("restart budget is spent" in h.agent.result.reason) == bool(max_restarts)


def test_a_report_on_a_replaced_child_is_no_news() -> None:
    h = harness(max_restarts=2)
    old = h.processes.named("worker:0")
    h.exit("worker:0", -9)
    h.agent.handle(Hung(old, 120, "stopped", "x"))
    assert h.agent.restarts.used == 1


def test_stuck_keeps_its_wire_format() -> None:
    message = Stuck("ps:1", "ps:1 on n2", "made no progress for 120 s (state: stopped)", 2)
    assert to_wire(message) == {"stuck": "ps:1", "label": "ps:1 on n2",
                                "what": "made no progress for 120 s (state: stopped)", "seen": 2}
    assert decode(to_wire(message)) == message


# -- blame: a peer's exit caused by a frozen process -----------------------------------------


class _Popen:
    def __init__(self, pid: int, ended: bool = False) -> None:
        self.pid, self.ended = pid, ended

    def poll(self) -> int | None:
        return 1 if self.ended else None


class _Child:
    def __init__(self, proc: Any, pid: int, ended: bool = False, tail: tuple[bytes, ...] = ()) -> None:
        self.proc, self.popen, self.tail, self.runs_script = proc, _Popen(pid, ended), tail, True


def guard_over(children: list[Any], plan: Any, tmp_path: Path) -> Any:
    from keras_distrib.launcher.watchdog import HangGuard

    return HangGuard(lambda _e: None, lambda: children, lambda _proc: None, lambda: plan.processes, tmp_path, 20.0)


@pytest.fixture()
def frozen() -> Any:
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while proc_state(child.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    yield child
    child.kill()
    child.wait()


def test_blame_names_the_frozen_peer_the_error_names(tmp_path: Path, frozen: Any) -> None:
    from cluster_parsers import JobInfo
    from keras_distrib.plan import build_plan

    plan = build_plan(JobInfo("local", "1", ("local0", "local1"), (1, 1)), "allreduce", hosts={"local0": "127.0.0.1", "local1": "127.0.0.1"})
    w0, w1 = plan.processes
    failed = _Child(w0, 1, ended=True, tail=(UNHEALTHY.rstrip(b"\n") + b" /job:worker/replica:0/task:1\n",))
    guard = guard_over([failed, _Child(w1, frozen.pid)], plan, tmp_path)
    culprit, what = guard.blame(failed)
    assert culprit.proc is w1
    assert what.startswith("stopped sending heartbeats (named by worker:0's error) (state: stopped); its Python stacks: ")
    assert (tmp_path / "worker-1.stacks.txt").is_file()
    # Not on this node: named from the plan; its own agent keeps the stacks at the restart.
    culprit, what = guard_over([failed], plan, tmp_path).blame(failed)
    assert culprit is w1 and "its node's agent keeps its Python stacks" in what
    # JAX's name for the same task
    jax_failed = _Child(w0, 1, ended=True, tail=(b"...tasks are unhealthy (stopped sending heartbeats): /job:jax_worker/task:1\n",))
    assert guard_over([jax_failed], plan, tmp_path).blame(jax_failed)[0] is w1
    # Its own error, nothing frozen: no blame.
    own = _Child(w0, 1, ended=True, tail=(b"ValueError: x\n",))
    assert guard_over([own, _Child(w1, os.getpid())], plan, tmp_path).blame(own) is None


def test_blame_without_a_named_peer_takes_a_frozen_local_one(tmp_path: Path, frozen: Any) -> None:
    from cluster_parsers import JobInfo
    from keras_distrib.plan import build_plan

    plan = build_plan(JobInfo("local", "1", ("local0", "local1"), (1, 1)), "allreduce", hosts={"local0": "127.0.0.1", "local1": "127.0.0.1"})
    w0, w1 = plan.processes
    failed = _Child(w0, 1, ended=True, tail=(b"UnavailableError: socket closed\n",))
    culprit, what = guard_over([failed, _Child(w1, frozen.pid)], plan, tmp_path).blame(failed)
    assert culprit.proc is w1 and what.startswith("made no progress (state: stopped)")


# -- stragglers --------------------------------------------------------------------------------


def test_a_straggler_is_named_after_two_slow_epochs() -> None:
    from keras_distrib.trainers.base import epoch_line
    from keras_distrib.trainers.stragglers import slow_workers

    def stats(epoch: int, rates: dict[int, float]) -> dict[str, Any]:
        return {"epoch": epoch, "seconds": 2.0, "steps_per_sec": sum(rates.values()), "worker_steps_per_sec": rates}

    assert slow_workers({0: 10.0, 1: 4.9}) == {1: pytest.approx(0.49)}
    assert slow_workers({0: 10.0, 1: 5.0}) == {}  # half: not clearly slower
    assert slow_workers({0: 10.0, 1: 9.0, 2: 3.0}) == {2: 3.0 / 9.5}
    assert slow_workers({0: 10.0}) == {} and slow_workers({}) == {}
    first, second, third = stats(0, {0: 4.5, 1: 1.9}), stats(1, {0: 20.0, 1: 6.0}), stats(2, {0: 20.0, 1: 19.0})
    assert epoch_line(first, 3) == "epoch 1/3: 2.0 s, 6.4 steps/s (worker 0: 4.5, worker 1: 1.9 steps/s)"
    assert epoch_line(second, 3, first).endswith("; worker 1 is a straggler: 0.30x the others' steps/s for 2 epochs")
    assert "straggler" not in epoch_line(third, 3, second)
    assert "straggler" not in epoch_line(second, 3, None)  # the first epoch of a fit: no judgment
    # A worker failed (its closures ran again) in either epoch: the rates measure the recovery.
    for before, now in ((first, second), (second, first)):
        assert "straggler" not in epoch_line({**now, "workers_recovered": True}, 3, before)
        assert "straggler" not in epoch_line(now, 3, {**before, "workers_recovered": True})


def test_blame_needs_a_lasting_disk_sleep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI: a peer failing its own collective was seen once in D (a page read on a loaded disk)
    and blamed for process 0's deliberate exit; one look at D is not a freeze."""
    from cluster_parsers import JobInfo
    from keras_distrib.launcher import watchdog
    from keras_distrib.plan import build_plan

    plan = build_plan(JobInfo("local", "1", ("local0", "local1"), (1, 1)), "allreduce", hosts={"local0": "127.0.0.1", "local1": "127.0.0.1"})
    w0, w1 = plan.processes
    failed = _Child(w0, 1, ended=True, tail=(b"SystemExit: 3\n",))
    looks = iter(["D", "D", "R"])
    monkeypatch.setattr(watchdog, "proc_state", lambda pid: next(looks, "S"))
    monkeypatch.setattr(watchdog, "BLOCKED_PROOF_SECONDS", 0.3)
    assert guard_over([failed, _Child(w1, os.getpid())], plan, tmp_path).blame(failed) is None
    assert not watchdog.stays_blocked(os.getpid(), 0.3)  # (the patched looks ran out: "S")
    # Always D: blamed, after the proof.
    monkeypatch.setattr(watchdog, "proc_state", lambda pid: "D")
    monkeypatch.setattr(watchdog, "dump_stacks", lambda pid, path, what: "not kept: test")
    assert watchdog.stays_blocked(os.getpid(), 0.3)
    culprit, what = guard_over([failed, _Child(w1, os.getpid())], plan, tmp_path).blame(failed)
    assert culprit.proc is w1 and what.startswith("made no progress (state: uninterruptible disk sleep")
