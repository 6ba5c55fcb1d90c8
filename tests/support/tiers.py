"""Test tiers by cost: which marker a test gets, read from the fixtures it asks for.

``tests/conftest.py`` applies these before ``-m``/``-k`` deselect anything, so ``-m pure``
(``make test-fast``) selects exactly the tests that need no cluster, no Airflow, no tracking
server and no training run. A test whose cost does not show in its fixtures (it calls
``tests.support.cluster`` or trains in-process by itself) carries the marker in its module.
"""

from __future__ import annotations

from collections.abc import Iterable

# Cost markers, cheapest last. Every one is registered in pyproject.toml (a test checks it).
CLUSTER = "cluster"
AIRFLOW = "airflow"
SERVERS = "servers"
TRAINING = "training"
COSTLY = (CLUSTER, AIRFLOW, SERVERS, TRAINING)
PURE = "pure"

# Fixture -> the cost it brings. item.fixturenames is the closure, so a fixture built on one of
# these (e.g. mlflow_client on mlflow_server) is covered by its base.
FIXTURE_TIERS: dict[str, str] = {
    "local_cluster": CLUSTER,
    "dags_test_env": AIRFLOW,
    "standalone": AIRFLOW,
    "servers": SERVERS,
    "moto_s3": SERVERS,
    "uncut": TRAINING,
    "sigterm_job": TRAINING,
    "config_for": TRAINING,
    "trained": TRAINING,
}

# The fixtures that need the session's MLflow + moto S3 stack booted (tests/conftest.py).
STACK_FIXTURE = "servers"


def tiers_of(fixturenames: Iterable[str], markers: Iterable[str]) -> set[str]:
    """The cost markers a test gets: its own plus those of its fixtures; ``pure`` if none."""
    found = {m for m in markers if m in COSTLY}
    found |= {FIXTURE_TIERS[f] for f in fixturenames if f in FIXTURE_TIERS}
    return found or {PURE}
