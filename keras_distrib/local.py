"""`python -m keras_distrib.local --nodes N SCRIPT`: emulate N nodes on this machine."""

from .launcher.cli import main

if __name__ == "__main__":
    main(None, "python -m keras_distrib.local", local=True)
