# Two commands do all the set-up on a fresh machine (Python >= 3.11):
#   make demo   - install into .venv, then train on 2 emulated nodes (local mode)
#   make test   - install into .venv, then run the whole test suite
#   make docs   - build the documentation site into site/ (make docs-serve: serve it locally)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,legacy,bench,jax,docs,tuner]"
	touch $(STAMP)

.PHONY: install demo test docs docs-serve
install: $(STAMP)

demo: $(STAMP)
	$(PY) -m keras_distrib.local --nodes 2 examples/digits_distrib.py --epochs 5

test: $(STAMP)
	$(PY) -m pytest

# Strict: a broken link, a missing page or an unknown API symbol fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict --dev-addr 127.0.0.1:8000
