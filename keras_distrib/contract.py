"""The agent-to-child contract: the variables the launcher sets for every process it starts."""

from __future__ import annotations

PROTOCOL_VAR = "KERAS_DISTRIB_PROTOCOL"
STARTUP_TIMEOUT_VAR = "KERAS_DISTRIB_STARTUP_TIMEOUT"
