PYTHON ?= python3

.PHONY: install test lint serve bench

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test]' -e ./bench   # bench/: its own distribution (kvtier bench)
	$(PYTHON) -m engine.cli download-model
	$(PYTHON) -m kvkernels   # the C++ CPU kernels, built once for this CPU and torch

test: install
	$(PYTHON) -m pytest -q -n 2 tests   # two workers: much of the suite waits on servers it started

lint:
	ruff check .

serve: install
	kvtier serve --kv-offload cpu,disk

# Every registered workload at its default size, then docs/BENCHMARKS.md from the results.
# A subset: make bench BENCH_WORKLOADS="rag throughput"
BENCH_WORKLOADS ?= $(shell $(PYTHON) -c "from bench.cli import WORKLOADS; print(' '.join(WORKLOADS))")

bench: install
	set -e; for workload in $(BENCH_WORKLOADS); do $(PYTHON) -m bench $$workload; done
	$(PYTHON) -m bench.report
