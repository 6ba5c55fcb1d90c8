"""``CampaignStageOperator``: a non-training stage's Slurm job that also reports to MLflow.

Used by the DAG factory for the data stage, export and evaluate when the campaign's tracking
is on. When its job ends, whether it succeeded or failed (a failed gate's report is what
people need to see), the stage gets a child run of the campaign's run (tag ``pp.stage``) with
its job script and log, result JSON, Slurm accounting, and its own files, read from the
cluster over SFTP:

    raw_gate    reports/raw_gate.json, reports/data_docs/ (the GX Data Docs pages)
    token_gate  reports/token_gate.json, data/manifest.json
    tokenize    results/tokenize.json, data/manifest.json
    export      results/export.json, configs/config.json (never the weights)
    evaluate    eval/evaluate.json; its figures also on the campaign's run
    others      results/<stage>.json

Tracking never fails or holds up the stage: an error is logged, MLflow down means the
tracker spools.
"""

from __future__ import annotations

import json
import posixpath
from typing import TYPE_CHECKING, Any, NamedTuple

from operators.campaign.adapters.code_ship import CampaignJobOperator
from operators.campaign.render.layout import Layout
from operators.slurm.operator import SlurmJobOperator
from operators.tracking.artifacts import CONFIGS, DATA, EVAL, REPORTS
from operators.tracking.links import MlflowRunLink

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.errors import SlurmJobFailed
    from operators.slurm.hook import SlurmHook
    from operators.slurm.messages import JobSummary

RESULTS = "results"  # the result JSON of a stage that is neither a gate nor an evaluation
# Only the pages and their styles: GX's fonts and images are 4 MB of every Data Docs site.
DOC_SUFFIXES = (".html", ".css")
# The Data Docs folder keeps every earlier validation's page; the newest fit in this budget.
MAX_TREE_BYTES = 4 << 20


class Source(NamedTuple):
    """A file (or, with ``tree``, a folder) on the cluster and its artifact folder."""

    artifact_dir: str
    remote: str
    tree: bool = False


RESULT_DIRS = {"raw_gate": REPORTS, "token_gate": REPORTS, "evaluate": EVAL}


def stage_sources(stage: str, layout: Layout) -> list[Source]:
    """What each stage leaves behind that people look at, besides its result JSON."""
    return {
        "raw_gate": [Source(f"{REPORTS}/data_docs",
                            posixpath.join(layout.raw_gate, "data_docs"), tree=True)],
        "tokenize": [Source(DATA, layout.manifest)],
        "token_gate": [Source(DATA, layout.manifest)],
        "export": [Source(CONFIGS, posixpath.join(layout.hf_export, "config.json"))],
    }.get(stage, [])


def _tree(hook: SlurmHook, source: Source) -> dict[str, bytes]:
    """The folder's pages, newest first, until ``MAX_TREE_BYTES``."""
    files = [f for f in hook.list_files(source.remote) if f[0].endswith(DOC_SUFFIXES)]
    picked, total = {}, 0
    for rel, size, _mtime in sorted(files, key=lambda f: f[2], reverse=True):
        if total + size > MAX_TREE_BYTES:
            continue
        picked[f"{source.artifact_dir}/{rel}"] = hook.read_bytes(
            posixpath.join(source.remote, rel), 0, size)
        total += size
    return picked


def stage_files(hook: SlurmHook, layout: Layout, stage: str, result: Any) -> dict[str, bytes | str]:
    """Artifact path -> content for one stage's child run (the job's script and log aside)."""
    files: dict[str, bytes | str] = {}
    if result is not None:
        files[f"{RESULT_DIRS.get(stage, RESULTS)}/{stage}.json"] = json.dumps(
            result, indent=2, sort_keys=True)
    for source in stage_sources(stage, layout):
        if source.tree:
            files.update(_tree(hook, source))
        else:
            name = f"{source.artifact_dir}/{posixpath.basename(source.remote)}"
            files[name] = hook.read_bytes(source.remote, 0, MAX_TREE_BYTES)
    return files


class CampaignStageOperator(CampaignJobOperator):
    """One non-training stage of ``campaign`` (``stage``: ``raw_gate``, ``export``, ...) as a
    Slurm job; the other arguments are ``SlurmJobOperator``'s (see operators/campaign/stages)."""

    operator_extra_links = (*SlurmJobOperator.operator_extra_links, MlflowRunLink())

    def __init__(self, *, campaign: Campaign, stage: str, **kwargs: Any) -> None:
        super().__init__(campaign=campaign, **kwargs)
        self.stage = stage

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        """MLflow gets the stage, FAILED when its job failed (a failed step still writes its
        result JSON, jobscripts/common.py: e.g. every check of a failed gate); a tracking
        failure must not change the stage's outcome."""
        from operators.campaign.adapters.tracking import track_stage

        try:
            layout = Layout.for_campaign(self.campaign)
            files = stage_files(self.hook, layout, self.stage, summary.result)
            track_stage(self.campaign, self.hook, layout, context, self.stage, summary, files,
                        "FAILED" if failure is not None else "FINISHED")
        except Exception:  # noqa: BLE001 - logged; the stage's own outcome stands
            self.log.exception("tracking stage %s in MLflow failed", self.stage)
