# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= models/pdserve-tiny-code

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned exactly: the CPU wheel on disk, not a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	touch $(STAMP)

install: $(STAMP)

# A local cluster (router + workers as processes), prompts over gRPC, then shutdown.
demo: $(STAMP)
	$(PY) -m pdserve.launch.demo --model $(MODEL)

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m pdserve.bench.offline

clean:
	rm -rf $(VENV) build *.egg-info
