# Two commands for a fresh machine (see README):
#   make sample   set up, then recompute the bundled sample run under RLOO
#   make test     set up, then run the test suite (everything; CI runs this)
#   make test-fast  the same without the tests marked slow (browser, Ray, subprocesses, benchmarks)
#   make test-order the whole suite twice in two random orders (pytest-randomly seeds), each in parallel
#   make lint     ruff over the tree (rules in pyproject.toml)
#   make typecheck  mypy over the whole package (rldiag/)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SAMPLE ?= samples/grpo-tool
# the tests run in parallel, one process per core (pytest-xdist); a test marked
# xdist_group("NAME") runs in the same process as the others of its group (a Ray cluster, a wheel)
JOBS   ?= auto
PYTEST := $(BIN)/python -m pytest -n $(JOBS) --dist loadgroup

.PHONY: setup sample test test-fast test-order lint typecheck bench clean

# the compiled kernels (rldiag/engine/native/*.c) are built by the editable install: a change to
# one sets the venv up again
$(BIN)/.installed: pyproject.toml setup.py $(wildcard rldiag/engine/native/*.c)
	$(PYTHON) -m venv $(VENV)
	# torch first, from the local CPU wheel: left to itself pip would fetch a CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[app,wandb,dev]'
	# verl itself, for the tests against it: without its dependencies (they pull a CUDA stack), then
	# what its tested modules import (the `verl` extra), torch named again so pip keeps the CPU wheel
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1
	$(BIN)/python -m pip install -q -e '.[verl]' torch==2.13.0
	# bytecode for the editable sources, as a regular install has it (PYTHONDONTWRITEBYTECODE
	# would otherwise have every command compile them again)
	$(BIN)/python -m compileall -q rldiag app >/dev/null
	touch $@

setup: $(BIN)/.installed

sample: setup
	$(BIN)/rldiag recompute $(SAMPLE) --estimator rloo --save-tokens

test: setup
	@rc=0; $(PYTEST) -p no:randomly $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

test-fast: setup
	@rc=0; $(PYTEST) -p no:randomly -m "not slow" $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

# no order dependence: the same suite in two other orders (the seeds are printed; rerun one with
# `make test-order SEEDS=N`)
SEEDS ?= 1 2
test-order: setup
	@for seed in $(SEEDS); do $(PYTEST) --randomly-seed=$$seed $(PYTEST_ARGS) || exit $$?; done

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/bench_recompute.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
