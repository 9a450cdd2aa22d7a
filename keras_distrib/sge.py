"""`python -m keras_distrib.sge`: plan and launch under SGE (see keras_distrib.launcher.cli)."""

from .launcher.cli import main

if __name__ == "__main__":
    main("sge", "python -m keras_distrib.sge")
