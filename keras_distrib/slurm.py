"""`python -m keras_distrib.slurm`: plan and launch under SLURM (see keras_distrib.cli)."""

from .cli import main

if __name__ == "__main__":
    main("slurm", "python -m keras_distrib.slurm")
