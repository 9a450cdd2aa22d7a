"""Requeue the batch job after SCRIPT checkpointed on a preemption or time-limit signal.

One command per scheduler (`scontrol requeue`, `qrerun`, `brequeue`); SGE requeues a job
whose script exits with 99. When requeue is off or impossible, one line says why, and
the exit code is `PREEMPTED_EXIT_CODE` (the checkpoint is written either way).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping

from ..contract import PREEMPTED_EXIT_CODE

#: scheduler -> (job-id variable, requeue command before the id)
COMMANDS = {
    "slurm": ("SLURM_JOB_ID", ["scontrol", "requeue"]),
    "pbs": ("PBS_JOBID", ["qrerun"]),
    "lsf": ("LSB_JOBID", ["brequeue"]),
}
#: An SGE job script that exits with 99 is rescheduled by SGE itself.
SGE_RESCHEDULE_EXIT = 99
REQUEUE_TIMEOUT = 30.0


def requeue(scheduler: str, environ: Mapping[str, str], enabled: bool, say: Callable[[str], None]) -> int:
    """Requeue this job if ``enabled`` and possible; return the agent's exit code. ``say`` gets each line (the agent passes its logger)."""
    if not enabled:
        say("not requeued (requeue is off: pass --requeue); resubmit the same job to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    if scheduler == "sge":
        say(f"requeueing: exiting with {SGE_RESCHEDULE_EXIT}, which makes SGE reschedule the job (qsub -r y).")
        return SGE_RESCHEDULE_EXIT
    if scheduler not in COMMANDS:
        say(f"cannot requeue: a {scheduler} job is not a batch job; run it again to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    variable, command = COMMANDS[scheduler]
    job_id = environ.get(variable)
    if not job_id:
        say(f"cannot requeue: {variable} is not set (not a batch job); resubmit to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    if shutil.which(command[0]) is None:
        say(f"cannot requeue: {command[0]!r} is not on PATH (inside a container?); resubmit the job to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    argv = [*command, job_id]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT)
    except subprocess.TimeoutExpired:
        say(f"cannot requeue: {' '.join(argv)} did not answer within {REQUEUE_TIMEOUT:.0f} s; resubmit the job to resume.")
        return PREEMPTED_EXIT_CODE
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        say(f"cannot requeue: {' '.join(argv)} failed ({reason[-1] if reason else f'exit code {done.returncode}'}); "
            "resubmit the job to resume from the checkpoint.")
        return PREEMPTED_EXIT_CODE
    say(f"requeued job {job_id} ({' '.join(argv)}); it resumes from the checkpoint when it starts again.")
    return 0
