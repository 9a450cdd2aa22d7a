"""Launch options: defaults, a YAML config file, and command-line overrides."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import yaml

from cluster_parsers import ClusterConfigError

from ..checkpoint_interval import INTERVAL_HINT, IntervalError, parse_interval

LAYOUTS = ("ps-per-node", "worker-per-gpu", "allreduce")
PORT_BASE_VAR = "KERAS_DISTRIB_PORT_BASE"


@dataclass(frozen=True)
class Options:
    """Everything a user can set with a flag or a config-file key (dashes or underscores)."""

    layout: str = "ps-per-node"
    port_base: int | None = None
    protocol: str = "grpc"
    interface: str | None = None
    startup_timeout: float = 180.0
    shutdown_grace: float = 3.0
    scheduler: str | None = None
    # Resilience (README "Resilience"): restarts of dead processes, requeue on preemption.
    max_restarts: int = 3
    requeue: bool = False
    checkpoint_every: str | None = None  # None: keras_distrib.checkpoint_interval.DEFAULT_EVERY

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name.replace("_", "-") for f in fields(cls)]

    def merged(self, overrides: dict[str, Any]) -> Options:
        """A copy with the non-None ``overrides`` applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def load_config(path: str) -> dict[str, Any]:
    """Read a YAML config file into Options field values, rejecting unknown keys."""
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ClusterConfigError(f"--config {path!r} cannot be read ({exc.strerror}).", "check the path.") from None
    except yaml.YAMLError as exc:
        raise ClusterConfigError(f"--config {path!r} is not valid YAML ({exc}).", "fix its syntax.") from None
    if not isinstance(data, dict):
        raise ClusterConfigError(f"--config {path!r} is not a mapping of option: value.", "e.g. 'layout: allreduce'.")
    valid = {f.name: f for f in fields(Options)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in valid:
            raise ClusterConfigError(
                f"--config {path!r} has unknown key {key!r}.",
                f"valid keys are: {', '.join(Options.keys())}.",
            )
        values[name] = value
    return values


def validate(options: Options) -> Options:
    """Check option values before anything starts."""
    if options.layout not in LAYOUTS:
        raise ClusterConfigError(f"layout={options.layout!r} is unknown.", f"use one of: {', '.join(LAYOUTS)}.")
    for name in ("startup_timeout", "shutdown_grace"):
        value = getattr(options, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ClusterConfigError(f"{name.replace('_', '-')}={value!r} must be a positive number of seconds.", "e.g. 120.")
    if isinstance(options.max_restarts, bool) or not isinstance(options.max_restarts, int) or options.max_restarts < 0:
        raise ClusterConfigError(f"max-restarts={options.max_restarts!r} must be a whole number >= 0.", "e.g. --max-restarts 3 (0: fail fast).")
    if not isinstance(options.requeue, bool):
        raise ClusterConfigError(f"requeue={options.requeue!r} must be true or false.", "e.g. 'requeue: true' in --config.")
    if options.checkpoint_every is not None:
        try:
            parse_interval(str(options.checkpoint_every))
        except IntervalError:
            raise ClusterConfigError(f"checkpoint-every={options.checkpoint_every!r} is not an interval.", INTERVAL_HINT) from None
    if options.port_base is not None and not isinstance(options.port_base, int):
        raise ClusterConfigError(f"port-base={options.port_base!r} is not an integer.", "e.g. --port-base 23000.")
    return options
