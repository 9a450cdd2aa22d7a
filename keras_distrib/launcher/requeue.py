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
#: scheduler -> (the variables naming what a lost node holds, the command that ends it).
#: Slurm cancels only the step (a batch script's later commands still run); elsewhere the
#: tasks belong to the job itself.
END_STEP_COMMANDS = {
    "slurm": (("SLURM_JOB_ID", "SLURM_STEP_ID"), ["scancel"]),
    "sge": (("JOB_ID",), ["qdel"]),
    "pbs": (("PBS_JOBID",), ["qdel"]),
    "lsf": (("LSB_JOBID",), ["bkill"]),
}


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


def end_step(scheduler: str, environ: Mapping[str, str], say: Callable[[str], None]) -> None:
    """Cancel the job step (Slurm) or job this agent runs in, so its launcher returns now."""
    if scheduler not in END_STEP_COMMANDS:
        return  # local mode: every agent is on this machine
    variables, command = END_STEP_COMMANDS[scheduler]
    missing = [v for v in variables if not environ.get(v)]
    if missing:
        say(f"cannot end the step: {', '.join(missing)} not set. HINT: the scheduler ends it once it gives the "
            "node up; cancel it yourself to return sooner.")
        return
    if shutil.which(command[0]) is None:
        say(f"cannot end the step: {command[0]!r} is not on PATH. HINT: the scheduler ends it once it gives the "
            "node up; cancel it yourself to return sooner.")
        return
    argv = [*command, ".".join(environ[v] for v in variables)]
    say(f"ending the step ({' '.join(argv)}) so the launcher does not wait for the lost node.")
    try:
        # The command may signal this very process (it is one of the step's tasks): the
        # caller has already stopped everything and reported the job's end.
        subprocess.run(argv, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT)
    except (subprocess.TimeoutExpired, OSError) as exc:
        say(f"cannot end the step: {' '.join(argv)} failed ({exc}). HINT: the scheduler ends it once it gives the "
            f"node up; run {' '.join(argv)} yourself to return sooner.")
