# Two commands do all the set-up on a fresh machine (Python >= 3.11):
#   make demo   - install into .venv, then train on 2 emulated nodes (local mode)
#   make test   - install into .venv, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,legacy,bench,jax]"
	touch $(STAMP)

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)
	$(PY) -m keras_distrib.local --nodes 2 examples/digits_distrib.py --epochs 5

test: $(STAMP)
	$(PY) -m pytest
