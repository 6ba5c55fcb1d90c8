"""Register an exported model in MLflow's model registry, with its lineage, idempotently.

One registered model per campaign (its name is the caller's choice); one version per exported
checkpoint iteration. A version carries lineage tags: campaign, dataset manifest hash,
checkpoint iteration, config hash, and the evaluation metrics; the newest registration gets
the alias ``candidate`` (promotion past candidate is a person's decision, not the DAG's).

The export is an ``ExportSource``: where it is (recorded in the version's tags) and a way to
get a local copy of it. ``LocalExport`` is a directory on this machine; the campaign DAG passes
one that fetches the directory from the cluster over SFTP
(operators/campaign/adapters/export_fetch.py), so nothing assumes the cluster's disk is mounted
where Airflow runs.

Steps, each safe to repeat after a crash or an Airflow retry:
1. a version whose tags name this campaign and iteration already exists -> return it
   (alias set again); nothing else is logged twice, nothing is fetched;
2. the export directory is uploaded as artifacts of a child run of the campaign's run
   (``export-iter_XXXXXXX``, runs.child_run: found again if an earlier attempt created it);
   an upload counts once the run is tagged complete, so a half-done upload is redone; the
   local copy is made only for the upload;
3. the evaluation metrics go on the campaign's run (step = iteration, so several exports make
   a curve; a metric already there at that step, logged by the evaluate task, is not logged
   again) and on the export run;
4. the version is created from ``runs:/<export run>/model`` and the alias moved to it.
Two registrations of the same iteration racing each other could both create a version: the
DAG runs one registration task per campaign, so this is not guarded further.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jobscripts.vocabulary import EVAL_METRICS
from operators.tracking.names import EXPORT_KIND, KIND_TAG, UPLOADED_TAG
from operators.tracking.runs import _quoted, child_run, finish_run

CANDIDATE_ALIAS = "candidate"
ARTIFACT_PATH = "model"


@dataclass(frozen=True)
class Lineage:
    campaign: str
    iteration: int
    dataset_manifest_hash: str | None = None
    config_hash: str | None = None

    def tags(self) -> dict[str, str]:
        tags = {"campaign": self.campaign, "checkpoint_iteration": str(self.iteration)}
        if self.dataset_manifest_hash:
            tags["dataset_manifest_hash"] = self.dataset_manifest_hash
        if self.config_hash:
            tags["config_hash"] = self.config_hash
        return tags


class ExportSource(Protocol):
    location: str  # where the export lives, as the version's ``export_dir`` tag says

    def local_copy(self) -> contextlib.AbstractContextManager[Path]:
        """A local directory holding the export, for the length of the ``with`` block."""


@dataclass(frozen=True)
class LocalExport:
    path: Path

    @property
    def location(self) -> str:
        return str(self.path)

    @contextlib.contextmanager
    def local_copy(self) -> Iterator[Path]:
        yield self.path


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    run_id: str  # the export run holding the artifacts
    source: str
    created: bool  # False: an earlier registration of this campaign + iteration was returned


def eval_metrics(evaluation: dict[str, Any] | None) -> dict[str, float]:
    """MLflow metric values from an eval.json; absent or non-numeric figures are left out."""
    values = {}
    for key, name in EVAL_METRICS.items():
        value = (evaluation or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[name] = float(value)
    return values


def find_version(client, name: str, lineage: Lineage):
    """The version already registered for this campaign + iteration, or None."""
    from mlflow.exceptions import MlflowException

    query = (f"name = {_quoted(name, 'model name')} and "
             f"tags.campaign = {_quoted(lineage.campaign, 'campaign')} and "
             f"tags.checkpoint_iteration = '{lineage.iteration}'")
    try:
        found = client.search_model_versions(query)
    except MlflowException:
        return None  # the registered model does not exist yet
    return min(found, key=lambda v: int(v.version)) if found else None


def export_run(client, campaign_run_id: str, lineage: Lineage) -> str:
    """The campaign's child run for this export: the same run again on a retry."""
    name = f"export-iter_{lineage.iteration:07d}"
    return child_run(client, campaign_run_id, name, {KIND_TAG: EXPORT_KIND, **lineage.tags()})


def _log_metrics(client, run_id: str, values: dict[str, float], step: int) -> None:
    if not values:
        return
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])


def _not_logged(client, run_id: str, values: dict[str, float], step: int) -> dict[str, float]:
    """Those of ``values`` the run has no value for at ``step``: the same figure twice at one
    step would show as two points of the curve."""
    return {name: value for name, value in values.items()
            if not any(m.step == step for m in client.get_metric_history(run_id, name))}


def _ensure_registered_model(client, name: str, campaign: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    try:
        client.create_registered_model(name, tags={"campaign": campaign},
                                       description=f"Exports of pre-training campaign {campaign}")
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _upload(client, run_id: str, export: ExportSource) -> None:
    with export.local_copy() as local:
        if not (Path(local) / "config.json").is_file():
            raise FileNotFoundError(f"{export.location}: no config.json (not an exported HF "
                                    "directory)")
        client.log_artifacts(run_id, str(local), ARTIFACT_PATH)
    client.set_tag(run_id, UPLOADED_TAG, "true")


def register_model(client, name: str, campaign_run_id: str,
                   export: ExportSource | str | Path, lineage: Lineage,
                   evaluation: dict[str, Any] | None = None,
                   alias: str = CANDIDATE_ALIAS, *,
                   campaign_figures: bool = True) -> Registration:
    """Register ``export`` (a verified HF directory, or a local path to one) as a version of
    ``name``.

    ``client`` is an ``mlflow.MlflowClient``; ``campaign_run_id`` the campaign's parent run;
    ``evaluation`` the evaluate step's result JSON (jobscripts/evaluate.py), if any.
    ``campaign_figures``: also put its figures on the campaign's run where it has none at that
    iteration; False when another writer owns them (the evaluation DAG's, for a reused
    evaluation: its values come with its job's timestamp, and these, logged first while that
    DAG's task had not yet logged, made a second point at the same step).
    """
    if isinstance(export, str | Path):
        export = LocalExport(Path(export))
    existing = find_version(client, name, lineage)
    if existing is not None:
        client.set_registered_model_alias(name, alias, existing.version)
        return Registration(name, existing.version, existing.run_id, existing.source, False)

    run_id = export_run(client, campaign_run_id, lineage)
    if client.get_run(run_id).data.tags.get(UPLOADED_TAG) != "true":
        _upload(client, run_id, export)
    metrics = eval_metrics(evaluation)
    if campaign_figures:
        _log_metrics(client, campaign_run_id, _not_logged(client, campaign_run_id, metrics,
                                                          lineage.iteration), lineage.iteration)
    _log_metrics(client, run_id, metrics, lineage.iteration)
    finish_run(client, run_id)

    _ensure_registered_model(client, name, lineage.campaign)
    source = f"runs:/{run_id}/{ARTIFACT_PATH}"
    tags = {**lineage.tags(), **{f"eval.{k}": f"{v:.6g}" for k, v in metrics.items()},
            "export_dir": export.location}
    heldout = (evaluation or {}).get("heldout") or {}
    if heldout.get("split"):  # which documents the figures are about: test or validation
        tags["eval.heldout_split"] = str(heldout["split"])
    version = client.create_model_version(name, source, run_id=run_id, tags=tags,
                                          description=f"{lineage.campaign} at iteration "
                                                      f"{lineage.iteration}")
    client.set_registered_model_alias(name, alias, version.version)
    return Registration(name, version.version, run_id, version.source, True)
