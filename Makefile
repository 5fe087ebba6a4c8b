# The two set-up commands of the README: `make run` and `make test`. Each makes .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PG_TEST_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
REDIS_TEST_URL ?= redis://127.0.0.1:6379/15

.PHONY: run test test-pg lint browser bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The worker trains with JAX + Tunix + Qwix (the `train` extra); the web process never imports them.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[train]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,train]'
	touch $(VENV)/.installed $@

run: $(VENV)/.installed  ## Tunedeck on embedded defaults: http://127.0.0.1:8000
	$(BIN)/tunedeck up

browser:  ## Debian's Chromium, for the browser tests (never a downloaded one)
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: $(VENV)/.installed-dev browser  ## the suite on SQLite and the server-less broker
	$(BIN)/pytest -q

# The tests that run a real server (web + worker), on PostgreSQL + Redis; the engine, merge and
# validator tests touch neither, and `make test` runs them.
SERVER_TESTS := tests/api tests/web tests/test_cli.py

test-pg: $(VENV)/.installed-dev browser  ## the server tests on PostgreSQL + Redis
	TUNEDECK_TEST_DATABASE_URL=$(PG_TEST_URL) TUNEDECK_TEST_BROKER_URL=$(REDIS_TEST_URL) $(BIN)/pytest -q $(SERVER_TESTS)

lint: $(VENV)/.installed-dev  ## ruff: lint and format check
	$(BIN)/ruff check app worker tests bench migrations
	$(BIN)/ruff format --check app worker tests bench migrations

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/datasets.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/merge.py
	$(BIN)/python bench/serve.py

clean:
	rm -rf $(VENV) data test-artifacts
