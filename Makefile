# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= models/pdserve-tiny-code

.PHONY: demo test install bench clean prometheus

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned exactly: the CPU wheel on disk, not a CUDA build. pip
	# compiles the bytecode: with PYTHONDONTWRITEBYTECODE set (as on these machines)
	# nothing else would, and every process would compile torch again on import.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench,ray]'
	touch $(STAMP)

install: $(STAMP)

# A local cluster (router + workers as processes), prompts over gRPC, then shutdown.
demo: $(STAMP)
	$(PY) -m pdserve.launch.demo --model $(MODEL)

# Prometheus and promtool (Debian's package): the observability tests run a real server.
PROMETHEUS := $(shell command -v prometheus 2>/dev/null)
PROMTOOL := $(shell command -v promtool 2>/dev/null)

prometheus:
ifeq ($(and $(PROMETHEUS),$(PROMTOOL)),)
	apt-get update
	apt-get install -y prometheus
endif

# The suite on two pytest-xdist workers (one per core), each test file one unit of work
# (its module's cluster started once), in the order tests/conftest.py derives from the
# files' markers: 13.7-14.7 min from a fresh clone on a 2-core AVX2 machine, install included
# (docs/benchmarks.md, "make test wall time").
# `make test TEST_WORKERS=1` runs it in one process. Bytecode is written (even where
# PYTHONDONTWRITEBYTECODE is set): the suite's few hundred processes then compile each
# of our modules, and pytest rewrites each test module and plugin, once, not each time.
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),1)
PYTEST_WORKERS :=
else
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
endif

test: $(STAMP) prometheus
	promtool check rules deploy/prometheus/pdserve-rules.yaml
	promtool test rules deploy/prometheus/pdserve-rules.test.yaml
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(PYTEST_WORKERS) tests

bench: $(STAMP)
	$(PY) -m pdserve.bench.engine.offline

clean:
	rm -rf $(VENV) build *.egg-info
