"""`python -m keras_distrib`: auto-detect the scheduler, then plan or launch."""

from .cli import main

main()
