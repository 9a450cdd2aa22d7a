"""`python -m keras_distrib.slurm`: plan and launch under SLURM (see keras_distrib.launcher.cli)."""

from .launcher.cli import main

if __name__ == "__main__":
    main("slurm", "python -m keras_distrib.slurm")
