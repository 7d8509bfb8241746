# The two commands a person needs: `make test` (and, once the elastic core lands, `make demo`).
# Both run `make setup` first, which installs everything from this checkout's own files.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup lint test demo bench-store bench-core clean

setup: $(STAMP)

$(STAMP): scripts/setup.sh constraints.txt requirements-dev.txt pyproject.toml
	VENV=$(VENV) bash scripts/setup.sh
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

# Store latency and throughput figures (not a test): see bench/store_bench.py.
bench-store: setup
	$(BIN)/python bench/store_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Elastic core vs horovodrun: recovery after SIGKILL and steady throughput (about 10 minutes).
bench-core: setup
	$(BIN)/python bench/core_bench.py

# The CNN digits example under elastic-run: 2 workers, a third joins, one is killed; then the
# final accuracy and the sample audit's verdict (about 1-2 minutes after set-up).
demo: setup
	$(BIN)/python examples/demo.py
