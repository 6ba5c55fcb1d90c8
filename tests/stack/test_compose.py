"""docker/compose.yml and docker/local_stack.sh describe one stack: the same services, with their
settings from one file, docker/stack.env. No Docker engine runs here, so compose itself never
starts; what is checked is the YAML compose reads and the script the stack tests run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yml"
STACK_ENV = DOCKER / "stack.env"
SCRIPT = DOCKER / "local_stack.sh"
# compose's long-running service -> local_stack.sh's component names (one per replica).
NATIVE = {
    "postgres": ["postgres"], "redis": ["redis"], "seaweedfs": ["seaweedfs"], "mlflow": ["mlflow"],
    "airflow-apiserver": ["api-server"], "airflow-scheduler": ["scheduler"],
    "airflow-dag-processor": ["dag-processor"],
    "airflow-triggerer": ["triggerer-1", "triggerer-2"],
    "airflow-worker": ["worker-1", "worker-2"],
}
# Not part of the stack local_stack.sh runs: the cluster (docker/local_cluster.sh natively) and
# the one-shot set-up services (the script's own steps: initdb, migrations, bucket, s3.json).
OUTSIDE = {"slurm", "slurm-connection"}
ONE_SHOT = {"airflow-init", "seaweedfs-config", "seaweedfs-init"}
# Services whose settings come from stack.env (the ones local_stack.sh starts with it).
WITH_STACK_ENV = {"airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                  "airflow-triggerer", "airflow-worker", "mlflow", "seaweedfs"}


def stack_env() -> dict[str, str]:
    """stack.env's KEY=VALUE lines (compose's env_file and bash's ``source`` read them alike)."""
    values = {}
    for number, line in enumerate(STACK_ENV.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        # A whole value in single quotes (JSON) is taken literally by both.
        match = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(?:'([^']*)'|([^\s'\"]*))", line)
        assert match, f"{STACK_ENV}:{number}: not a KEY=VALUE line without quotes: {line!r}"
        values[match.group(1)] = match.group(2) if match.group(2) is not None else match.group(3)
    return values


def bash_array(name: str) -> list[str]:
    """A ``NAME=(a b "${OTHER[@]}")`` array of local_stack.sh, with arrays it names expanded."""
    match = re.search(rf"^{name}=\((.*)\)$", SCRIPT.read_text(), re.M)
    assert match, f"{SCRIPT} has no array {name}"
    words = []
    for word in match.group(1).split():
        inner = re.fullmatch(r'"\$\{(\w+)\[@\]\}"', word)
        words += bash_array(inner.group(1)) if inner else [word]
    return words


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_the_same_services_as_local_stack(compose) -> None:
    services = compose["services"]
    assert set(services) == set(NATIVE) | OUTSIDE | ONE_SHOT
    replicas = []
    for name, native in NATIVE.items():
        assert services[name].get("scale", 1) == len(native), name
        replicas += native
    assert sorted(replicas) == sorted(bash_array("COMPONENTS"))
    assert not [s for s in services if "minio" in s]
    assert "minio" not in COMPOSE.read_text().lower()


def test_settings_come_from_stack_env(compose) -> None:
    """Every stack service reads stack.env and sets none of its keys itself; every PP_ setting
    of stack.env is used by both the compose file and the script."""
    env = stack_env()
    for name in WITH_STACK_ENV:
        service = compose["services"][name]
        files = [f if isinstance(f, str) else f["path"] for f in service.get("env_file", [])]
        assert "stack.env" in files, f"{name} does not read stack.env"
        overridden = set(service.get("environment") or {}) & set(env)
        assert not overridden, f"{name} sets {overridden} itself (stack.env has them)"
    script, text = SCRIPT.read_text(), COMPOSE.read_text()
    assert 'source "$REPO_ROOT/docker/stack.env"' in script
    for key in (k for k in env if k.startswith("PP_")):
        assert f"${key}" in script, f"local_stack.sh does not use {key}"
        assert key in text, f"compose.yml does not use {key}"


def test_nothing_secret_in_stack_env() -> None:
    secret = re.compile(r"PASSWORD|SECRET|_KEY$|TOKEN")
    assert not [k for k in stack_env() if secret.search(k)]


def test_seaweedfs_release_is_stack_envs(compose) -> None:
    """Compose cannot read an env_file into an image tag: the tag is written out, and must be
    the release the native stack installs."""
    version = stack_env()["PP_SEAWEEDFS_VERSION"]
    for name in ("seaweedfs", "seaweedfs-config"):
        assert compose["services"][name]["image"] == f"chrislusf/seaweedfs:{version}"


def test_two_workers_and_two_triggerers_on_celery(compose) -> None:
    env = stack_env()
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    airflow_env = compose["x-airflow-env"]
    assert airflow_env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
    assert airflow_env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://")
    mlflow = compose["services"]["mlflow"]["environment"]
    assert mlflow["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql")
    assert mlflow["MLFLOW_S3_ENDPOINT_URL"] == "http://seaweedfs:8333"
    assert (compose["services"]["airflow-worker"]["scale"],
            compose["services"]["airflow-triggerer"]["scale"]) == (2, 2)
