# pretrain-pipeline: the commands the README names. Everything runs as root on Debian 12.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install cluster-up cluster-down cluster-status test test-fast lint bench demo demo-down stack-up stack-status stack-down

install:
	bash docker/bootstrap.sh

cluster-up: install
	bash docker/local_cluster.sh up

cluster-down:
	bash docker/local_cluster.sh down

cluster-status:
	bash docker/local_cluster.sh status

# The test command of the README and of .ci/run: the suite in lanes (tests/lanes.py: the stack's
# story beside the rest, then the disruptive tests alone); with PYTEST_ARGS, plain pytest.
test: cluster-up
	$(VENV)/bin/python -m tests.lanes $(PYTEST_ARGS)

# Everyday work: the pure tier only (no cluster, Airflow, MLflow/S3 servers or training), after
# `make install`; tiers are read from the fixtures a test uses (tests/support/tiers.py).
test-fast:
	$(VENV)/bin/pytest -q -p no:cacheprovider -m pure $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check operators plugins jobscripts dags tests

bench: cluster-up
	$(PY) -m tests.bench.run_all

# STACK=production: the same demo on docker/local_stack.sh's stack (PostgreSQL, Celery workers,
# two triggerers, MLflow with artifacts on SeaweedFS); its servers are restarted if they run with
# other DAGs (the stack tests' own). `make stack-down` stops that stack.
STACK ?= standalone
demo: cluster-up
ifeq ($(STACK),production)
	PP_STACK_REPLACE=1 bash docker/local_stack.sh up
	$(PY) -m operators.demo up production
else
	$(PY) -m operators.demo up
endif

# The production stack alone (docker/local_stack.sh), with the repository's DAGs.
stack-up: cluster-up
	bash docker/local_stack.sh up

stack-status:
	bash docker/local_stack.sh status

stack-down:
	bash docker/local_stack.sh down

demo-down:
	-$(PY) -m operators.demo down
	bash docker/local_cluster.sh down
