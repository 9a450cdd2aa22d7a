"""Launch options: defaults, a YAML config file, and command-line overrides."""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from cluster_parsers import ClusterConfigError, all_parsers
from cluster_parsers.static import read_yaml

from ..checkpoint_interval import INTERVAL_HINT, IntervalError, parse_interval
from ..contract import KERAS_BACKEND_VAR
from ..plan import JAX_LAYOUTS

LAYOUTS = ("ps-per-node", "worker-per-gpu", "allreduce", "jax", "jax-per-gpu", "tuner")
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
    verbose: bool = False
    heartbeat_timeout: float = 30.0
    isolate: bool = True
    # Resilience (docs/faults.md): restarts of dead processes, requeue on preemption.
    max_restarts: int = 3
    requeue: bool = False
    # Elastic (docs/faults.md, Node loss): when a node other than the first is lost and at
    # least this many nodes remain, the job goes on on them (None: stop or requeue as before).
    min_nodes: int | None = None
    # Nodes that come back after a drop rejoin up to this many (None: the job's size).
    max_nodes: int | None = None
    # The first agent writes the job's exit code to this file (a job script reports it: elastic.sbatch).
    exit_code_file: str | None = None
    checkpoint_every: str | None = None  # None: keras_distrib.checkpoint_interval.DEFAULT_EVERY
    # Every process's full output: LOG_DIR/SCHEDULER-JOBID/JOB-INDEX.log (None: ./keras_distrib-logs).
    log_dir: str | None = None
    # Hangs (docs/faults.md): seconds without progress before the job acts on the stuck
    # process (0: no watchdog). 300 s: longer than any pause of a healthy job between two
    # scheduled functions (a checkpoint save, an epoch end, a validation pass counts its
    # own steps), and a SCRIPT's limit also grows to 3x its longest gap seen.
    hang_timeout: float = 300.0
    # A process the plan gives GPUs exits with code 2 when TensorFlow (or JAX) sees fewer,
    # instead of warning and training on the CPU (keras_distrib/gpus.py).
    require_gpus: bool = False
    # A heterogeneous job: what each component's nodes run, "workers,ps" (None: the first
    # component computes, the others hold the parameter servers; keras_distrib/plan.py).
    component_roles: str | None = None
    # Where the scheduler does not name a job's components (PBS, LSF): the nodes of each,
    # in the node list's order, "2,1".
    component_sizes: str | None = None
    # Layout tuner: KerasTuner trial workers per node (None: one per GPU, one on a node without).
    tuners_per_node: int | None = None

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name.replace("_", "-") for f in fields(cls)]

    def merged(self, overrides: dict[str, Any]) -> Options:
        """A copy with the non-None ``overrides`` applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def load_config(path: str) -> dict[str, Any]:
    """Read a YAML config file into Options field values, rejecting unknown keys."""
    where = f"--config {path!r}"
    data = read_yaml(where, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{where} is not a mapping of option: value.", "e.g. 'layout: allreduce'.")
    valid = {f.name: f for f in fields(Options)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if not isinstance(key, str) or name not in valid:
            raise ClusterConfigError(
                f"{where} has unknown key {key!r}.",
                f"valid keys are: {', '.join(Options.keys())}.",
            )
        if value is None:
            raise ClusterConfigError(f"{where} gives {key!r} no value.", f"remove the key or give it a value, e.g. {_example(name)}.")
        values[name] = value
    return values


#: Examples for HINTs where the default (None) shows nothing.
_EXAMPLES: dict[str, Any] = {"port_base": 23000, "interface": "ib0", "scheduler": "pbs", "log_dir": "logs",
                             "component_roles": "workers,ps", "component_sizes": "2,1"}


def _example(name: str) -> str:
    """``key: value`` for a HINT, from the field's default or its type."""
    default = _EXAMPLES.get(name, getattr(Options(), name))
    if default is None:
        hints = typing.get_type_hints(Options)[name]
        kinds = [t for t in typing.get_args(hints) if t is not type(None)] or [hints]
        default = {int: 23000, float: 60.0, str: "name", bool: True}.get(kinds[0], "...")
    return f"{name.replace('_', '-')}: {json_scalar(default)}"


def json_scalar(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _has_type(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits a field annotation such as ``int | None`` (bool is not an int)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for kind in typing.get_args(annotation) if union else (annotation,):
        if kind is type(None):
            ok = value is None
        elif kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif kind is str:
            ok = isinstance(value, str) and bool(value.strip()) and value.isprintable()
        else:
            ok = isinstance(value, typing.get_origin(kind) or kind)
        if ok:
            return True
    return False


def _describe(annotation: Any) -> str:
    """'an integer', 'a number', ... for an error message."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    words = {int: "an integer", float: "a finite number", str: "a non-empty text", bool: "true or false"}
    kinds = [k for k in (typing.get_args(annotation) if union else (annotation,)) if k is not type(None)]
    return " or ".join(words.get(k, getattr(k, "__name__", str(k))) for k in kinds)


def check_types(options: Options) -> None:
    """Every field holds a value of its declared type (config files can hold anything)."""
    annotations = typing.get_type_hints(Options)
    for f in fields(Options):
        value = getattr(options, f.name)
        if not _has_type(value, annotations[f.name]):
            raise ClusterConfigError(
                f"{f.name.replace('_', '-')}={value!r} is not {_describe(annotations[f.name])}.",
                f"write e.g. {_example(f.name)}.",
            )


def validate(options: Options) -> Options:
    """Check option values before anything starts."""
    check_types(options)
    if options.layout not in LAYOUTS:
        raise ClusterConfigError(f"layout={options.layout!r} is unknown.", f"use one of: {', '.join(LAYOUTS)}.")
    for name in ("startup_timeout", "shutdown_grace", "heartbeat_timeout"):
        value = getattr(options, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ClusterConfigError(f"{name.replace('_', '-')}={value!r} must be a positive number of seconds.", "e.g. 120.")
    if not isinstance(options.hang_timeout, (int, float)) or options.hang_timeout < 0:
        raise ClusterConfigError(f"hang-timeout={options.hang_timeout!r} must be a number of seconds >= 0.",
                                 "e.g. --hang-timeout 300 (0: no hang watchdog).")
    if isinstance(options.max_restarts, bool) or not isinstance(options.max_restarts, int) or options.max_restarts < 0:
        raise ClusterConfigError(f"max-restarts={options.max_restarts!r} must be a whole number >= 0.", "e.g. --max-restarts 3 (0: fail fast).")
    if not isinstance(options.requeue, bool):
        raise ClusterConfigError(f"requeue={options.requeue!r} must be true or false.", "e.g. 'requeue: true' in --config.")
    if options.min_nodes is not None and (isinstance(options.min_nodes, bool) or not isinstance(options.min_nodes, int)
                                          or options.min_nodes < 1):
        raise ClusterConfigError(f"min-nodes={options.min_nodes!r} must be a whole number >= 1.",
                                 "e.g. --min-nodes 2 (the job goes on while at least 2 nodes are left).")
    if options.max_nodes is not None and (isinstance(options.max_nodes, bool) or not isinstance(options.max_nodes, int)
                                          or options.max_nodes < 1):
        raise ClusterConfigError(f"max-nodes={options.max_nodes!r} must be a whole number >= 1.",
                                 "e.g. --max-nodes 3 (nodes that come back rejoin up to 3 nodes).")
    if options.checkpoint_every is not None:
        try:
            parse_interval(str(options.checkpoint_every))
        except IntervalError:
            raise ClusterConfigError(f"checkpoint-every={options.checkpoint_every!r} is not an interval.", INTERVAL_HINT) from None
    if options.port_base is not None and not isinstance(options.port_base, int):
        raise ClusterConfigError(f"port-base={options.port_base!r} is not an integer.", "e.g. --port-base 23000.")
    if options.scheduler is not None:
        known = [cls.name for cls in all_parsers()]
        if options.scheduler not in known:
            raise ClusterConfigError(f"scheduler={options.scheduler!r} is not a known scheduler.", f"use one of: {', '.join(known)}.")
    if not isinstance(options.isolate, bool):
        raise ClusterConfigError(f"isolate={options.isolate!r} is not true or false.", "e.g. 'isolate: false' or --no-isolation.")
    _check_tuner_options(options)
    if not isinstance(options.verbose, bool):
        raise ClusterConfigError(f"verbose={options.verbose!r} is not true or false.", "e.g. 'verbose: true' or --verbose.")
    return options


def _check_tuner_options(options: Options) -> None:
    """--tuners-per-node only with layout tuner; layout tuner without --min-nodes."""
    per_node = options.tuners_per_node
    if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1):
        raise ClusterConfigError(f"tuners-per-node={per_node!r} must be a whole number >= 1.",
                                 "e.g. --tuners-per-node 2 (two KerasTuner trial workers per node).")
    if per_node is not None and options.layout != "tuner":
        raise ClusterConfigError(f"--tuners-per-node {per_node} is for layout tuner, but the layout is {options.layout}.",
                                 "add --layout tuner, or drop --tuners-per-node.")
    if options.layout == "tuner" and options.min_nodes is not None:
        raise ClusterConfigError(
            f"--min-nodes {options.min_nodes} with layout tuner: a search does not go on without a node.",
            "drop --min-nodes; a dead trial worker is restarted (--max-restarts) and a requeued search resumes "
            "from its directory (--requeue).",
        )


#: The parameter-server layouts, and the Keras backends they train with (`Plan.backend`).
PS_LAYOUTS = ("ps-per-node", "worker-per-gpu")
PS_BACKENDS = ("tensorflow", "jax")


def keras_backend(environ: Mapping[str, str]) -> tuple[str, str]:
    """The backend SCRIPT's Keras will pick, and where that comes from (as Keras decides it:
    ``KERAS_BACKEND``, else ``backend`` in ``$KERAS_HOME/keras.json`` or ``~/.keras/keras.json``)."""
    if environ.get(KERAS_BACKEND_VAR):
        return environ[KERAS_BACKEND_VAR], f"{KERAS_BACKEND_VAR}={environ[KERAS_BACKEND_VAR]}"
    home = Path(environ.get("KERAS_HOME") or Path(environ.get("HOME") or Path.home()) / ".keras")
    try:
        backend = json.loads((home / "keras.json").read_text()).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    return (backend, f"backend in {home / 'keras.json'}") if isinstance(backend, str) else ("tensorflow", "")


def ps_backend(layout: str, environ: Mapping[str, str]) -> str:
    """`Plan.backend`: the Keras backend of a parameter-server layout (tensorflow elsewhere)."""
    backend, _ = keras_backend(environ)
    return backend if layout in PS_LAYOUTS and backend in PS_BACKENDS else "tensorflow"


def check_backend(layout: str, environ: Mapping[str, str]) -> None:
    """Refuse, before anything starts, a layout whose framework is not the backend Keras will use."""
    backend, source = keras_backend(environ)
    if layout in PS_LAYOUTS and backend not in PS_BACKENDS:
        raise ClusterConfigError(
            f"Keras will run on {backend} ({source}), but layout {layout} trains on TensorFlow or JAX only.",
            f"set KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow for layout {layout} (docs/training.md says what "
            "was tried with torch).",
        )
    if layout == "allreduce" and backend != "tensorflow":
        raise ClusterConfigError(
            f"Keras will run on {backend} ({source}), but layout {layout} trains with TensorFlow's tf.distribute.",
            "use --layout jax (synchronous, keras.distribution) or ps-per-node (asynchronous) for Keras on JAX, "
            "or --layout tuner for a KerasTuner search; or set KERAS_BACKEND=tensorflow for layout allreduce.",
        )
    if layout in JAX_LAYOUTS and environ.get(KERAS_BACKEND_VAR, "jax") != "jax":
        raise ClusterConfigError(
            f"{KERAS_BACKEND_VAR}={environ[KERAS_BACKEND_VAR]}, but layout {layout} runs Keras on JAX.",
            "unset KERAS_BACKEND (the layout sets it to jax), or use --layout allreduce or ps-per-node for "
            "TensorFlow.",
        )
