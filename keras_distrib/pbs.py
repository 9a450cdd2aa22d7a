"""`python -m keras_distrib.pbs`: plan and launch under PBS (see keras_distrib.launcher.cli)."""

from .launcher.cli import main

if __name__ == "__main__":
    main("pbs", "python -m keras_distrib.pbs")
