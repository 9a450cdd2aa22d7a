"""`python -m keras_distrib.sge`: plan and launch under SGE (see keras_distrib.cli)."""

from .cli import main

if __name__ == "__main__":
    main("sge", "python -m keras_distrib.sge")
