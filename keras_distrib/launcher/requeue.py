"""What agent 0 asks of the scheduler when the job cannot go on.

* ``requeue``: requeue the batch job after SCRIPT checkpointed on a preemption or time-limit
  signal, or after a node was lost with --requeue. One command per scheduler (`scontrol
  requeue`, `qrerun`, `brequeue`); SGE requeues a job whose script exits with 99. When
  requeue is off or impossible, one line says why, and the exit code is
  `PREEMPTED_EXIT_CODE` (the checkpoint is written either way).
* ``end_step``: a node was lost without --requeue. The launcher (srun, qrsh, mpirun, ...)
  would wait for the task on the unreachable node until the scheduler gives the node up
  (Slurm: SlurmdTimeout, 300 s by default), so the step is cancelled through the scheduler.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping

from cluster_parsers import ClusterParser, all_parsers

from ..contract import PREEMPTED_EXIT_CODE

REQUEUE_TIMEOUT = 30.0


def scheduler_class(scheduler: str) -> type[ClusterParser] | None:
    """The parser class registered as ``scheduler``: its commands and variables are class data."""
    return {cls.name: cls for cls in all_parsers()}.get(scheduler)


def job_id(parser: type[ClusterParser], environ: Mapping[str, str]) -> str | None:
    return next((environ[v] for v in parser.job_id_vars if environ.get(v)), None)


def requeue(scheduler: str, environ: Mapping[str, str], enabled: bool, say: Callable[[str], None]) -> int:
    """Requeue this job if ``enabled`` and possible; return the agent's exit code. ``say`` gets each line (the agent passes its logger)."""
    if not enabled:
        say("not requeued (requeue is off: pass --requeue); resubmit the same job to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    parser = scheduler_class(scheduler)
    if parser is not None and parser.reschedule_exit_code is not None:
        code = parser.reschedule_exit_code
        say(f"requeueing: exiting with {code}, which makes {scheduler.upper()} reschedule the job.")
        return code
    if parser is None or parser.requeue_command is None:
        say(f"cannot requeue: a {scheduler} job is not a batch job; run it again to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    command, job = list(parser.requeue_command), job_id(parser, environ)
    if not job:
        say(f"cannot requeue: {' or '.join(parser.job_id_vars)} is not set (not a batch job); resubmit to resume "
            "from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    if shutil.which(command[0]) is None:
        say(f"cannot requeue from here: {command[0]!r} is not on PATH (inside a container?); exiting with "
            f"{PREEMPTED_EXIT_CODE}, for a job script outside to requeue (scripts/sbatch/apptainer.sbatch and "
            "pyxis.sbatch do), or resubmit the job to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    argv = [*command, job]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT)
    except subprocess.TimeoutExpired:
        say(f"cannot requeue: {' '.join(argv)} did not answer within {REQUEUE_TIMEOUT:.0f} s; resubmit the job to resume.")
        return PREEMPTED_EXIT_CODE
    if done.returncode == -signal.SIGTERM:
        # Slurm ends every process of the job's step, scontrol among them, as it requeues
        # the job: seen in CI (the job came back and resumed). Only then is it killed so.
        say(f"requeued job {job} ({' '.join(argv)} was ended by SIGTERM as the scheduler ended this step to "
            "requeue it); it resumes from the checkpoint when it starts again.")
        return 0
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        say(f"cannot requeue: {' '.join(argv)} failed ({reason[-1] if reason else f'exit code {done.returncode}'}); "
            "resubmit the job to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    say(f"requeued job {job} ({' '.join(argv)}); it resumes from the checkpoint when it starts again.")
    return 0


def end_step(scheduler: str, environ: Mapping[str, str], say: Callable[[str], None]) -> None:
    """Cancel the job step (Slurm) or job this agent runs in, so its launcher returns now."""
    parser = scheduler_class(scheduler)
    if parser is None or parser.end_command is None:
        return  # no scheduler to ask: local mode, a static hosts file
    command = list(parser.end_command)
    ids = [job_id(parser, environ), *([environ.get(parser.step_id_var)] if parser.step_id_var else [])]
    if not all(ids):
        names = [" or ".join(parser.job_id_vars)] + ([parser.step_id_var] if parser.step_id_var else [])
        missing = [name for name, value in zip(names, ids) if not value]
        say(f"cannot end the step: {', '.join(missing)} not set. HINT: the scheduler ends it once it gives the "
            "node up; cancel it yourself to return sooner.")
        return
    if shutil.which(command[0]) is None:
        say(f"cannot end the step: {command[0]!r} is not on PATH. HINT: the scheduler ends it once it gives the "
            "node up; cancel it yourself to return sooner.")
        return
    argv = [*command, ".".join(ids)]
    say(f"ending the step ({' '.join(argv)}) so the launcher does not wait for the lost node.")
    try:
        # The command may signal this very process (it is one of the step's tasks): the
        # caller has already stopped everything and reported the job's end.
        subprocess.run(argv, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT)
    except (subprocess.TimeoutExpired, OSError) as exc:
        say(f"cannot end the step: {' '.join(argv)} failed ({exc}). HINT: the scheduler ends it once it gives the "
            f"node up; run {' '.join(argv)} yourself to return sooner.")
