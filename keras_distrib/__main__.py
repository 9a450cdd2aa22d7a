"""`python -m keras_distrib`: auto-detect the scheduler, then plan or launch."""

from .launcher.cli import main

main()
