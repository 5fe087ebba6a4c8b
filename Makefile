# The two set-up commands of the README: `make run` and `make test`. Each makes .venv itself.
PYTHON ?= python3

# Python writes each module's bytecode on its first import (the install compiles none: --no-compile below).
# With PYTHONDONTWRITEBYTECODE set, as some shells and images set it, it writes none, and every process
# compiles JAX, Tunix and the rest from source again: importing the trainer took 11.8 s instead of 5.2 s,
# in each of the many processes a run, a model server and the test suite start.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
PG_TEST_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
REDIS_TEST_URL ?= redis://127.0.0.1:6379/15

.PHONY: run test test-pg lint browser bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The worker trains with JAX + Tunix + Qwix (the `train` extra); the web process never imports them.
# --no-compile: Python compiles a module when it is first imported, not every file of every package now
# (most of torch, JAX and TensorFlow's are never imported here): the install takes half as long.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e '.[train]'
	touch $@

# The tests also read configs written by transformers 5.18, whose Gemma 4 config states the global
# layers' shape as `per_layer_config`. It needs safetensors>=0.8 and Tunix needs <0.8, so it lives in a
# folder of its own that only tests/checkpoints.py's writer puts on its path.
NEW_TRANSFORMERS := $(VENV)/transformers-5.18

$(VENV)/.installed-dev: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e '.[dev,train]'
	rm -rf $(NEW_TRANSFORMERS)
	$(BIN)/pip install -q --no-compile --no-deps --target $(NEW_TRANSFORMERS) \
		transformers==5.18.0 tokenizers==0.23.2 safetensors==0.8.0
	touch $(VENV)/.installed $@

run: $(VENV)/.installed  ## Tunedeck on embedded defaults: http://127.0.0.1:8000
	$(BIN)/tunedeck up

browser:  ## Debian's Chromium, for the browser tests (never a downloaded one)
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# Two test processes (pytest-xdist): much of the suite waits on servers, so one process leaves the
# cores idle. A module's tests stay in one process (loadfile), so its fixtures are built once; each
# process starts its own session server. TEST_WORKERS=0: the one pytest process.
TEST_WORKERS ?= 2

# The schema fuzzer runs once, against PostgreSQL (`make test-pg`, which CI runs beside this): the
# errors only a database server raises (integers and text it refuses) are found there, and whatever
# else answers 5xx does so whatever the database. Its focused tests run here too.
ON_PG_ONLY := --deselect tests/api/test_fuzz.py::test_no_input_makes_a_server_error

test: $(VENV)/.installed-dev browser  ## the suite on SQLite and the server-less broker
	$(BIN)/pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile $(ON_PG_ONLY)

# The API and CLI tests, which run a real server (web + worker), again on PostgreSQL + Redis. Not
# again there: the engine, merge, model-server and validator tests (they touch neither), the browser
# tests (the pages call the same API, which tests/api covers on PostgreSQL), and the artifact-store
# test (fsspec; the lost-worker re-queue it also covers runs on PostgreSQL in the run SIGKILL test), and the
# Gemma 4 release chain (file formats; its train, merge and deploy steps run on PostgreSQL in their own tests),
# the broker test (it runs its own Redis whatever the suite), and the body-cap and security-header tests
# (middleware in front of everything: no database involved), and the endpoint-judge test (what a judge
# stores, its sealed key and its verdicts, the URL-judge test stores on PostgreSQL too), and the arena
# and promotion tests (two more model servers each: their rows are plain; the gateway's lookup of a
# name, which a promotion relies on, is tested on PostgreSQL by the endpoint tests), and the perplexity
# cross-check with transformers (arithmetic over what the SQLite suite stores alike), and the checkpoint
# evaluation (a merge and two model servers; evaluations are queued, run and stored on PostgreSQL + Redis
# by the URL-judge test), and the Ctrl-C hand-back across two starts of `up` (its re-queue is the send
# that a resume makes, which the SIGKILL test's re-queue makes on Redis; the SQLite suite runs it whole),
# and the fine-tuning jobs test (pause and resume: the same sends and conditional updates as the run
# tests there), the run from a registered URL (its copy is files; its run trains as any other), and
# the CLI's user and token commands (plain inserts through the server's own engine code; `db upgrade`
# does run there), the slice pool's workers and runs (two more workers: their rows are plain inserts
# and updates, and the re-queue of a lost host is `requeue_lost`, which the run SIGKILL test runs there), and the
# chips lease test (two runs, two merges and two model servers on another worker: a wait is an update of
# the row and a send with a countdown, which Celery's worker holds until it is due on either broker), and
# the run lost before its first checkpoint (its re-queue is the SIGKILL test's; what it adds, dropping the
# points past the step a new attempt starts from, is one plain delete), and the vLLM container's exchange
# with the Docker engine API (HTTP to a stand-in engine; its endpoint rows are the built-in server's, and
# the sweep of a dead supervisor's container does run there).
SERVER_TESTS := tests/api tests/test_cli.py
NOT_ON_PG := --deselect tests/api/test_artifacts.py::test_a_killed_build_is_requeued_and_lands_in_the_artifact_store \
	--deselect tests/api/test_gemma4_release.py --deselect tests/api/test_broker.py \
	--deselect tests/api/test_limits.py --deselect tests/api/test_headers.py \
	--deselect tests/api/test_evaluations.py::test_a_judge_endpoint_grades_every_answer_and_compares_answers_in_both_orders \
	--deselect tests/api/test_evaluations.py::test_the_arena_hides_names_until_the_vote_rates_models_and_exports_votes_as_preferences \
	--deselect tests/api/test_evaluations.py::test_promoting_a_checkpoint_into_an_endpoints_place_loses_no_request \
	--deselect tests/api/test_evaluations.py::test_the_references_perplexity_is_what_transformers_computes \
	--deselect tests/api/test_evaluations.py::test_checkpoints_and_the_base_are_served_asked_and_scored \
	--deselect tests/test_cli.py::test_first_start_prints_login_and_token_and_ctrl_c_hands_the_training_back \
	--deselect tests/api/test_runs_lifecycle.py::test_openai_fine_tuning_jobs \
	--deselect tests/api/test_base_models.py::test_a_run_trains_from_a_registered_url_copied_once_to_the_host \
	--deselect tests/test_cli.py::test_user_create --deselect tests/test_cli.py::test_token_create_prints_a_working_token \
	--deselect tests/test_cli.py::test_token_create_for_unknown_user_fails \
	--deselect tests/api/test_slice_runs.py --deselect tests/api/test_leases.py \
	--deselect tests/api/test_runs_lifecycle.py::test_a_run_lost_before_its_first_checkpoint_starts_over_with_each_step_once \
	--deselect tests/api/test_vllm_runtime.py::test_a_tpu_endpoint_runs_vllm_through_the_docker_engine_api

test-pg: $(VENV)/.installed-dev browser  ## the server tests on PostgreSQL + Redis
	TUNEDECK_TEST_DATABASE_URL=$(PG_TEST_URL) TUNEDECK_TEST_BROKER_URL=$(REDIS_TEST_URL) \
		$(BIN)/pytest -q --durations=15 $(SERVER_TESTS) $(NOT_ON_PG)

lint: $(VENV)/.installed-dev  ## ruff: lint and format check; pyright: type check of app/ and worker/
	$(BIN)/ruff check app worker tests bench migrations
	$(BIN)/ruff format --check app worker tests bench migrations
	$(BIN)/pyright

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/datasets.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/merge.py
	$(BIN)/python bench/serve.py
	$(BIN)/python bench/gateway.py
	$(BIN)/python bench/evals.py
	$(BIN)/python bench/slice.py

clean:
	rm -rf $(VENV) data test-artifacts
