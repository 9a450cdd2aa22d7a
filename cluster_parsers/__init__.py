"""Read a batch scheduler's environment into a plain, immutable job description.

Pure Python: importing this package never imports TensorFlow.
"""

from .base import (
    ClusterConfigError,
    ClusterParser,
    JobInfo,
    expand_hosts,
    expand_tasks_per_node,
    node_of_rank,
    split_gpu_ids,
)
from .lsf import LsfParser
from .pbs import PbsParser
from .registry import (
    BUILTIN_PARSERS,
    ENTRY_POINT_GROUP,
    FORCE_VAR,
    all_parsers,
    detect,
    get_parser,
    parse_job,
)
from .sge import SgeParser
from .slurm import SlurmParser
from .static import StaticParser
from .tasks import LauncherCounts, Tasks, launched_tasks, launcher_counts, mpi_rank

__all__ = [
    "BUILTIN_PARSERS",
    "ENTRY_POINT_GROUP",
    "FORCE_VAR",
    "ClusterConfigError",
    "ClusterParser",
    "JobInfo",
    "LsfParser",
    "PbsParser",
    "SgeParser",
    "SlurmParser",
    "StaticParser",
    "LauncherCounts",
    "Tasks",
    "all_parsers",
    "launched_tasks",
    "launcher_counts",
    "detect",
    "get_parser",
    "expand_hosts",
    "expand_tasks_per_node",
    "mpi_rank",
    "node_of_rank",
    "split_gpu_ids",
    "parse_job",
]
