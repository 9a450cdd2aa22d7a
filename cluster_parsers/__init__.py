"""Read a batch scheduler's environment into a plain, immutable job description.

Pure Python: importing this package never imports TensorFlow.
"""

from .base import ClusterConfigError, ClusterParser, JobInfo, node_of_rank
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
    "all_parsers",
    "detect",
    "get_parser",
    "node_of_rank",
    "parse_job",
]
