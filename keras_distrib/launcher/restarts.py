"""Which processes a death restarts, and the one line that says so (pure, unit-tested).

* all-reduce and jax: every worker holds a replica and they run in lockstep, so one death
  restarts all of them; SCRIPT resumes from its last checkpoint (like torchrun).
* parameter server, a worker dies: only that TF server restarts; TensorFlow's
  ClusterCoordinator re-runs its closures once it listens again.
* parameter server, a ps dies: the variables it held are gone and TensorFlow cannot
  reconnect a running coordinator to a new ps, so the ps AND the chief's SCRIPT restart;
  SCRIPT resumes from the last checkpoint. The workers keep running: a new coordinator
  re-creates its functions and datasets on them.
* the chief dies (a signal, not its own exit code): SCRIPT restarts and resumes.
* parameter server on JAX (``Plan.backend``), a worker dies or its SCRIPT fails (a lost ps
  connection is an error there): that worker restarts, finds the weights on the ps, and the
  chief hands out again what it had taken. A ps dies: everything restarts (the workers'
  connections to it are gone too) and resumes from the chief's last checkpoint.
* tuner, a trial worker dies: it restarts with its KERASTUNER_TUNER_ID, and KerasTuner's
  oracle hands it its unfinished trial again. The oracle (chief) dies: everything restarts;
  the new oracle reloads its state from the search's ``directory`` and retries the trials
  that were running.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import CHIEF, PS, TUNER, TUNER_LAYOUT, Plan


def restart_targets(plan: Plan, dead: str) -> list[str]:
    """Names (``job:index``) of the processes to restart after ``dead`` died."""
    if plan.layout == TUNER_LAYOUT:  # trial workers are independent; the oracle serves them all
        return [p.name for p in plan.processes] if dead.startswith(CHIEF) else [dead]
    if plan.every_process_runs_script:  # allreduce and jax: lockstep replicas
        return [p.name for p in plan.processes]
    job = dead.split(":", 1)[0]
    if job == PS and plan.backend == "jax":
        return [p.name for p in plan.processes]
    if job == PS:
        return [dead] + [p.name for p in plan.processes if p.job == CHIEF]
    return [dead]


def restart_line(label: str, how: str, targets: list[str], dead: str, used: int, budget: int,
                 what: str | None = None) -> str:
    """``worker:1 on n2 exited with signal 9 (SIGKILL); restarting it (1/3)``.

    ``what`` replaces ``exited with HOW`` (a stuck process: ``made no progress for 120 s ...``).
    """
    others = [t for t in targets if t != dead]
    if not others:
        todo = "restarting it" + ("; the oracle gives it its trial again" if dead.startswith(TUNER) else "")
    elif any(t.startswith(TUNER) for t in targets):
        todo = (f"restarting it and all {len(others)} trial workers; the search resumes from its directory, the "
                "running trials again")
    elif any(t.startswith(CHIEF) for t in others) and len(targets) == 2:
        todo = "restarting it and the chief's SCRIPT, which resumes from its last checkpoint"
    elif any(t.startswith(PS) for t in targets):
        todo = f"restarting all {len(targets)} processes, which resume from the chief's last checkpoint"
    else:
        todo = f"restarting all {len(targets)} workers, which resume from the last checkpoint"
    return f"{label} {what or 'exited with ' + how}; {todo} ({used}/{budget})"


@dataclass
class RestartCount:
    """The restarts agent 0 ordered against --max-restarts, and those carried out on this node."""

    used: int = 0  # agent 0: against the budget
    seen: int = 0  # carried out here (restarts and re-formings): a Stuck report from before is stale
