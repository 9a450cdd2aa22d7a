"""`python -m keras_distrib.lsf`: plan and launch under LSF (see keras_distrib.launcher.cli)."""

from .launcher.cli import main

if __name__ == "__main__":
    main("lsf", "python -m keras_distrib.lsf")
