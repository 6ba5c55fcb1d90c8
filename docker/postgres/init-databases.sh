#!/usr/bin/env bash
# NOT EXERCISED HERE: no Docker engine can run on the machine where this project is developed.
#
# Run by the postgres image's entrypoint from /docker-entrypoint-initdb.d, once, when the data
# volume is empty (docker/compose.yml mounts it there). One server, two databases, each owned by
# its own role, so that Airflow and MLflow cannot read or migrate each other's schema:
#   airflow  Airflow's metadata database (AIRFLOW_DB_PASSWORD)
#   mlflow   MLflow's backend store      (MLFLOW_DB_PASSWORD)
# Changing a password in docker/.env later does not reach an existing volume: use ALTER ROLE.
#
# The entrypoint sources this file when it is not executable (a checkout that lost the mode):
# so no `set -u`, which would stay on in the entrypoint's own shell after this file.
set -e

# Passwords go in as psql variables (:'name' quotes them as SQL literals), never spliced into SQL.
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname postgres \
  -v airflow_password="${AIRFLOW_DB_PASSWORD:?AIRFLOW_DB_PASSWORD is not set}" \
  -v mlflow_password="${MLFLOW_DB_PASSWORD:?MLFLOW_DB_PASSWORD is not set}" <<'SQL'
CREATE ROLE airflow LOGIN PASSWORD :'airflow_password';
CREATE DATABASE airflow OWNER airflow;
REVOKE ALL ON DATABASE airflow FROM PUBLIC;

CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';
CREATE DATABASE mlflow OWNER mlflow;
REVOKE ALL ON DATABASE mlflow FROM PUBLIC;
SQL
