# `make test` and `make demo` work on a fresh machine: they create .venv and install everything.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Pinned first: an unpinned torch pulls several GB of CUDA wheels; 2.13.0 resolves to the local CPU build.
TORCH  := torch==2.13.0

.PHONY: setup test test-all lint demo bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,demo]'
	$(PY) -m bps.compressors.warm  # numba's cache, so a job's processes do not compile
	$(PY) -m bps.worker.local_sum  # and the node agent's sums of several local ranks
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

# Most tests run real processes that wait on each other: two test processes keep two
# cores busy. A file's tests stay in one of them, so they share the file's clusters.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP) lint
	$(PYTEST) -m "not slow"

test-all: $(STAMP) lint
	$(PYTEST)

demo: $(STAMP)
	PYTHONUNBUFFERED=1 $(VENV)/bin/bpslaunch local --workers 2 --servers 1 -- \
		$(PY) examples/mnist.py --compressor onebit --ef vanilla --momentum nesterov

bench: $(STAMP)
	$(PY) bench/compressors.py

clean:
	rm -rf $(VENV) build *.egg-info
