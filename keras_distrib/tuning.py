"""Layout tuner: run an unchanged KerasTuner script as one process of a distributed search.

The agent starts ``python -m keras_distrib.tuning SCRIPT ARGS`` in every process of the
layout, with KerasTuner's variables set (contract.tuner_variables): the first node's
first process runs the oracle (``KERASTUNER_TUNER_ID=chief``), the others run trials.
Around SCRIPT this runner:

* turns SIGUSR1 (time-limit warning) and SIGTERM (preemption) into exit code 75, which the
  agent turns into a requeue: KerasTuner saves its oracle in the search's ``directory`` at
  every trial's start and end, and the requeued oracle retries the trials that were running;
  SIGINT (Ctrl-C) into exit code 130. Each ends the process even where Python would drop
  the exception (a gc callback);
* bounds a worker's wait for the oracle by ``--startup-timeout`` (KerasTuner waits an hour);
* prints one line per trial the oracle sees end, naming the worker that ran it;
* lets the oracle notice the search's end within 1 s (KerasTuner polls every 20 s), and
  keeps it serving after SCRIPT until no worker asked for ``ORACLE_IDLE`` seconds (a
  worker's own code after its search may ask it for the results).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import runpy
import signal
import sys
import threading
import time
from typing import Any, NoReturn

from . import contract, progress
from .logs import configure_script
from .plan import TUNER

# Named, not __name__: run with -m, this module is __main__, outside the keras_distrib logger.
logger = logging.getLogger("keras_distrib.tuning")


#: Seconds the SystemExit of a stop signal has to end the process before it is ended hard.
STOP_GRACE = 10.0
#: After SCRIPT ends on the oracle's process, it keeps serving until no worker asked for this long.
ORACLE_IDLE = 5.0


def _stop(signum: int, _frame: Any) -> NoReturn:
    # SIGUSR1/SIGTERM: KerasTuner's state is already on disk (the oracle saves at each
    # trial's start and end), so nothing to write; exit 75 asks the agent for a requeue,
    # and the running trials run again. SIGINT (Ctrl-C): stop with 130. An exception raised
    # where Python ignores exceptions (a gc or weakref callback, a __del__) is lost, so a
    # timer ends the process with the same code if it is still running.
    code = 128 + signum if signum == signal.SIGINT else contract.PREEMPTED_EXIT_CODE
    timer = threading.Timer(STOP_GRACE, os._exit, args=(code,))
    timer.daemon = True
    timer.start()
    after = "" if signum == signal.SIGINT else "; the search resumes from its directory after a requeue"
    logger.info(f"got {signal.Signals(signum).name}: stopping{after}")
    raise SystemExit(code)


def _report(nodes: dict[str, str], oracle: Any, tuner_id: str, trial_id: str) -> None:
    """One line per ended trial: who ran it (``nodes``: tuner id -> node), its score, the best
    so far, how many are done."""
    trial = oracle.trials[trial_id]
    best = oracle.get_best_trials(1)
    best_score = f"{best[0].score:.4g}" if best and best[0].score is not None else "none yet"
    score = f"{trial.score:.4g}" if trial.score is not None else "no score"
    total = f" of {oracle.max_trials}" if oracle.max_trials else ""
    where = f"{tuner_id} ({nodes[tuner_id]})" if tuner_id in nodes else tuner_id
    # The worker's error does not travel to the oracle (KerasTuner's protocol has no field
    # for it): name the worker's log file (launcher.workers.log_file_name), which has it.
    failed = trial.score is None and tuner_id.startswith(TUNER)
    why = f" (its error is in {TUNER}-{tuner_id.removeprefix(TUNER)}.log)" if failed else ""
    logger.info(f"trial {trial_id} {str(trial.status).lower()} on {where}{why}: {oracle.objective.name} {score} "
                f"(best {best_score}); trials ended: {len(oracle.end_order)}{total}")


def _tuner_nodes() -> dict[str, str]:
    """Each trial worker's node, by KERASTUNER_TUNER_ID, from the plan file (empty without one)."""
    plan = contract.read_plan(os.environ) or {"processes": []}
    return {f"tuner{p['index']}": p["node"] for p in plan["processes"] if p["job"] == TUNER}


def main(argv: list[str] | None = None) -> int:
    """Run SCRIPT (``argv[0]``) as ``__main__`` with ``argv`` as its ``sys.argv``."""
    from . import _private_apis

    argv = list(sys.argv[1:] if argv is None else argv)
    configure_script()
    if importlib.util.find_spec("keras_tuner") is None:
        logger.error("layout tuner runs KerasTuner, which is not installed here. "
                     "HINT: pip install 'keras-distrib[tuner]' (keras-tuner 1.4.8) in the job's environment")
        return contract.SETUP_EXIT_CODE
    progress.announce()  # the agent's "SCRIPT never called keras_distrib" does not apply
    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)
    oracle = os.environ.get(contract.TUNER_ID_VAR) == contract.ORACLE_TUNER_ID
    if oracle:
        idle = _private_apis.serve_oracle(functools.partial(_report, _tuner_nodes()), poll=1.0)
    else:
        _private_apis.limit_oracle_wait(contract.startup_timeout(os.environ))
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    if oracle:
        _answer_late_workers(idle)
    return 0


def _answer_late_workers(idle: Any) -> None:
    """After SCRIPT, keep the oracle serving until no worker asked for ORACLE_IDLE seconds:
    a worker's own code after its search (``tuner.results_summary()``) asks the oracle."""
    while (seconds := idle()) is not None and seconds < ORACLE_IDLE:
        time.sleep(ORACLE_IDLE - seconds)


if __name__ == "__main__":
    sys.exit(main())
