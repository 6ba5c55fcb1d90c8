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

A stage spread over the nodes (``data.array_tasks`` > 1: tokenization) is a Slurm job array
(one task per group of input shards) and then this operator's own job, the merge, submitted
with ``--dependency=afterok:<array>`` (:class:`ArrayFirst`): the task waits on the merge, so
the task id, its XCom and the merge's result stay what a single job's were. A failed array
task ends the merge (``--kill-on-invalid-dep``), and the task fails naming each failed array
task and its shards (the tasks' own result files). A retry re-attaches to a live or finished
array and submits a new one only after a failure: its tasks that finished skip (their done
records), the merge writes the manifest once, last.
"""

from __future__ import annotations

import json
import posixpath
from typing import TYPE_CHECKING, Any, NamedTuple

from operators.campaign.adapters.code_ship import CampaignJobOperator
from operators.campaign.render.layout import Layout
from operators.slurm.errors import SlurmJobFailed
from operators.slurm.jobkey import job_key
from operators.slurm.messages import JobLocation, JobRequest
from operators.slurm.operator import (
    PYTHON_ENV,
    SlurmJobOperator,
    build_spec,
    log_pattern_for,
    plain,
)
from operators.slurm.states import Outcome, classify
from operators.tracking.artifacts import CONFIGS, DATA, EVAL, REPORTS
from operators.tracking.links import MlflowRunLink

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
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


ARRAY_XCOM = "slurm_array_job"  # the array's JobLocation (log path: its %a pattern)
ARRAY_KEY_SUFFIX = ".array"  # the array's key: the task's, of task id "<task id>.array"


def task_result_name(result_file: str, task: int) -> str:
    """An array task's own result file in the array's run directory: ``result.json`` ->
    ``result_3.json`` (jobscripts.array_task.task_result_path writes it)."""
    stem, dot, suffix = result_file.rpartition(".")
    return f"{stem}_{task}.{suffix}" if dot else f"{result_file}_{task}"


class ArrayFirst:
    """For a campaign's stage operator: submit ``array_job`` (``{"command", "job",
    "environment", "tasks"}``, its job with ``array``) before this operator's own job, which
    then waits for it (``afterok``). Campaign values: never templates (not a template
    field), checked at DAG parse like the operator's own job."""

    def _init_array(self, array_job: dict) -> None:
        # Called by each operator class's own __init__: Airflow's operator metaclass wraps
        # only the __init__ of BaseOperator subclasses, which this mixin is not.
        self.array_job = dict(array_job)
        self.check_request(JobRequest(self.array_job["command"], self.array_job["job"],
                                      self.array_job["environment"]))

    def prepare_job(self, context: Context) -> JobRequest:
        request = super().prepare_job(context)  # the shipped code is on its PYTHONPATH
        array = self._array(context, plain(dict(request.environment)))
        if classify(array.state) is Outcome.SUCCESS:
            self.log.info("array job %s already succeeded: the merge runs at once",
                          array.job_id)
            return request
        self.log.info("merge job waits for array job %s (afterok)", array.job_id)
        return JobRequest(request.command, {**request.job,
                                            "dependency": f"afterok:{array.job_id}"},
                          request.environment, request.files, request.result_file)

    def _array(self, context: Context, environment: dict):
        """The array job of this try: a live or successful one re-attached, else submitted."""
        ti = context["ti"]
        key = job_key(ti.dag_id, ti.run_id, ti.task_id + ARRAY_KEY_SUFFIX, ti.map_index,
                      self.segment)
        run_dir = self.hook.run_dir(key)
        a = self.array_job
        env = {PYTHON_ENV: self.hook.settings.remote_python,
               **plain(dict(a["environment"])), **environment}
        spec = build_spec(key, run_dir, plain(a["command"]), plain(dict(a["job"])), env)
        record = self._attach_or_submit(spec, run_dir, key, {})
        ti.xcom_push(key=ARRAY_XCOM, value=JobLocation(
            record.job_id, log_pattern_for(spec, record.job_id), run_dir).to_json())
        return record

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        if failure is not None:
            failure = self._array_failure(context) or failure
        super().on_job_end(context, summary, failure)
        if failure is not None:
            raise failure

    def _array_failure(self, context: Context) -> SlurmJobFailed | None:
        """The array's failure, naming each failed task and its shards; None when the array
        succeeded (the merge itself failed) or cannot be read."""
        ti = context["ti"]
        info = ti.xcom_pull(task_ids=self.task_id, key=ARRAY_XCOM, map_indexes=ti.map_index)
        if not info:
            return None
        where = JobLocation.from_json(info)
        record = self.hook.describe(where.job_id)
        if record is None or classify(record.state) in (Outcome.SUCCESS, Outcome.ACTIVE):
            return None
        failed = []
        for task in range(self.array_job["tasks"]):
            result = self.hook.read_json(posixpath.join(
                where.run_dir, task_result_name(self.result_file, task))) or {}
            if not result.get("ok"):
                shards = ", ".join(result.get("shards") or ["unknown: no result"])
                error = result.get("error") or "no result file"
                failed.append(f"task {task} (shards {shards}): {error}")
        return SlurmJobFailed(
            f"array job {where.job_id} of {self.task_id} ended {record.state} "
            f"({record.state_detail}); {len(failed)} of {self.array_job['tasks']} tasks failed: "
            + "; ".join(failed) + f"; logs {where.log_path} (%a = task); the merge did not run")


class ArrayJobOperator(ArrayFirst, CampaignJobOperator):
    """A campaign's stage as a job array, then its merge job (tracking off)."""

    def __init__(self, *, array_job: dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_array(array_job)


class ArrayStageOperator(ArrayFirst, CampaignStageOperator):
    """A campaign's stage as a job array, then its merge job, tracked in MLflow."""

    def __init__(self, *, array_job: dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_array(array_job)
