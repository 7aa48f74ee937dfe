PYTHON ?= python3

.PHONY: install test lint serve bench

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test,bench]'

test: install
	$(PYTHON) -m pytest -q tests

lint:
	ruff check .

serve: install
	kvtier serve --kv-offload cpu,disk
