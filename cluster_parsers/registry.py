"""One registry of parsers: the built-ins in a fixed order, plus entry-point plugins."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points

from .base import ClusterConfigError, ClusterParser, JobInfo
from .lsf import LsfParser
from .pbs import PbsParser
from .sge import SgeParser
from .slurm import SlurmParser
from .static import StaticParser

ENTRY_POINT_GROUP = "cluster_parsers"
FORCE_VAR = "KERAS_DISTRIB_SCHEDULER"

# Detection order. Plugins come first: a site-specific parser knows its cluster better
# than a generic one. SLURM precedes the others because Slurm sites often also export
# PBS/LSF compatibility variables (e.g. PBS_JOBID via spank plugins), never the reverse.
# LSF and SGE come before PBS for the same reason; the static file is the last resort
# because KERAS_DISTRIB_HOSTS_FILE may linger in a user's shell profile.
BUILTIN_PARSERS: tuple[type[ClusterParser], ...] = (
    SlurmParser,
    LsfParser,
    SgeParser,
    PbsParser,
    StaticParser,
)


def plugin_parsers() -> list[type[ClusterParser]]:
    """Parsers registered by other packages under the ``cluster_parsers`` entry points."""
    found = []
    for ep in _entry_points(tuple(sys.path)):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken third-party plugin must not crash with a traceback
            raise ClusterConfigError(
                f"the {ENTRY_POINT_GROUP} plugin {ep.name} = {ep.value} failed to load ({type(exc).__name__}: {exc}).",
                "fix or uninstall the package that provides it (pip show / pip uninstall).",
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, ClusterParser)):
            raise ClusterConfigError(
                f"the {ENTRY_POINT_GROUP} plugin {ep.name} = {ep.value} is not a ClusterParser subclass.",
                "point the entry point at a subclass of cluster_parsers.ClusterParser.",
            )
        found.append(cls)
    return found


@functools.lru_cache(maxsize=8)
def _entry_points(path: tuple[str, ...]) -> tuple[EntryPoint, ...]:
    """The group's entry points, sorted by name, as seen from the import ``path`` (reading
    every installed distribution's metadata takes ~50 ms, and one launch asks several times)."""
    return tuple(sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name))


def all_parsers() -> list[type[ClusterParser]]:
    """Every parser in detection order."""
    builtin_names = {cls.name for cls in BUILTIN_PARSERS}
    plugins = [cls for cls in plugin_parsers() if cls.name not in builtin_names]
    return plugins + list(BUILTIN_PARSERS)


def get_parser(name: str, environ: Mapping[str, str] | None = None) -> ClusterParser:
    """The parser registered as ``name``; an unknown name lists the known ones."""
    parsers = {cls.name: cls for cls in all_parsers()}
    if name not in parsers:
        raise ClusterConfigError(
            f"{FORCE_VAR}={name!r} is not a known scheduler.",
            f"use one of: {', '.join(parsers)}.",
        )
    return parsers[name](environ)


def detect(environ: Mapping[str, str] | None = None) -> ClusterParser:
    """The parser for the scheduler that launched us (or the one forced by name)."""
    env = os.environ if environ is None else environ
    forced = env.get(FORCE_VAR)
    if forced:
        return get_parser(forced, env)
    for cls in all_parsers():
        parser = cls(env)
        if parser.is_present():
            return parser
    raise ClusterConfigError(
        "no scheduler detected (no SLURM_JOB_ID, LSB_JOBID, PE_HOSTFILE, PBS_JOBID or KERAS_DISTRIB_HOSTS_FILE).",
        "run inside a job (sbatch, qsub or bsub), use python -m keras_distrib.local --nodes N "
        f"for one machine, or set {FORCE_VAR}.",
    )


def parse_job(scheduler: str | None = None, environ: Mapping[str, str] | None = None) -> JobInfo:
    """Parse the job with the named parser, or auto-detect one."""
    parser = get_parser(scheduler, environ) if scheduler else detect(environ)
    return parser.parse()
