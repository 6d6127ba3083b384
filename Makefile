# `make demo` and `make test` each do the whole set-up on a fresh machine first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh "$(VENV)" "$(TORCH_VERSION)"
	touch $@

demo: setup
	$(VENV)/bin/hotspare run configs/demo.yaml

# Two test processes (pytest-xdist): the multi-process tests spend most of their time
# waiting (leases, sleeps, timeouts) -- one at a time keeps a 2-core machine ~30 % busy.
# A module whose tests share a cluster is one xdist_group. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests

lint: setup
	$(VENV)/bin/ruff check orchestrator agents recovery tests benchmarks examples

bench: setup
	$(PY) benchmarks/recovery_time.py --json benchmarks/out/recovery.json

clean:
	rm -rf $(VENV) .pytest_cache
