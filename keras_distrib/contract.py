"""The agent-to-child contract: the variables the launcher sets for every process it starts."""

from __future__ import annotations

PROTOCOL_VAR = "KERAS_DISTRIB_PROTOCOL"
STARTUP_TIMEOUT_VAR = "KERAS_DISTRIB_STARTUP_TIMEOUT"
# Resilience: the script's exit code after a checkpoint taken on SIGUSR1/SIGTERM (EX_TEMPFAIL:
# "try again later"), which the agent turns into a requeue; and the checkpoint interval.
PREEMPTED_EXIT_CODE = 75
CHECKPOINT_EVERY_VAR = "KERAS_DISTRIB_CHECKPOINT_EVERY"
