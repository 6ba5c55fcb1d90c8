"""``TrainingSegmentOperator``: one training segment of a campaign, as one Slurm job.

Before submitting it reads the checkpoint tracker (a campaign already done
skips), pins the dataset manifest at the first segment and refuses a changed one,
and renders the run config for the reference trainer or Megatron Bridge. After
the job it reads ``segment.json`` and fails loudly when the iteration did not
advance: a segment that makes no progress must never loop.

Once its job is queued or found, it pre-queues the next ``segments.prequeue_depth``
segments' jobs (operators/campaign/dag/prequeue.py, docs/prequeue.md); a segment task whose
job was pre-queued re-attaches to it by its key and counts progress from where that job
started.
"""

from __future__ import annotations

import json
import posixpath
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from jobscripts.job_files import SEGMENT_RESULT
from jobscripts.vocabulary import PREQUEUE_REFUSED
from operators.campaign.adapters.code_ship import ShipsCode, with_code
from operators.campaign.adapters.remote import (
    append_history,
    missing_files,
    read_history,
    read_iteration,
    read_text,
    write_file,
)
from operators.campaign.dag import prequeue
from operators.campaign.dag.watch import segment_watchers
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs, data_path
from operators.campaign.render.plan import SegmentNoProgress, check_progress, segment_end
from operators.slurm.jobkey import job_key
from operators.slurm.operator import PYTHON_ENV, SlurmJobOperator, build_spec
from operators.slurm.states import Outcome, classify
from operators.tracking.links import MlflowRunLink

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.errors import SlurmJobFailed
    from operators.slurm.hook import SlurmHook
    from operators.slurm.messages import JobRequest, JobSummary
    from operators.slurm.parse import JobRecord

XCOM_START = "segment_start_iteration"
XCOM_ATTACHED = "segment_ran_prequeued"  # the pre-queued job this task re-attached to
KEEP = (Outcome.ACTIVE, Outcome.SUCCESS)  # a job by the key that a task re-attaches to


def segment_request(campaign: Campaign, layout: Layout, inputs: RunInputs,
                    history: list[dict], train_iters: int | None) -> JobRequest:
    """The segment's job, by the campaign's path: the reference trainer or Megatron Bridge
    (the two renderers take the same arguments)."""
    if campaign.model.reference is not None:
        from operators.campaign.render.reference import reference_segment as render
    else:
        from operators.campaign.render.bridge import bridge_segment as render
    return render(campaign, layout, inputs, history, train_iters)


def pin_manifest(hook: SlurmHook, layout: Layout) -> dict | None:
    """Pin the dataset at the first segment; later segments refuse a different one."""
    from jobscripts import manifest as manifests

    current_text = read_text(hook, layout.manifest)
    if current_text is None:
        return None  # the campaign names its prefixes itself: nothing to pin
    current = json.loads(current_text)
    pinned_text = read_text(hook, layout.pinned_manifest)
    if pinned_text is None:
        write_file(hook, layout.pinned_manifest, current_text)
        return current
    manifests.assert_same(json.loads(pinned_text), current, where=layout.manifest)
    return current


class TrainingSegmentOperator(ShipsCode, SlurmJobOperator):
    """Segment ``segment`` of a DAG run: resume from the last checkpoint, train, save."""

    operator_extra_links = (*SlurmJobOperator.operator_extra_links, MlflowRunLink())

    def __init__(self, *, campaign: Campaign, segment: int, **kwargs: Any) -> None:
        super().__init__(
            ssh_conn_id=campaign.cluster.ssh_conn_id, segment=segment,
            # A job that hit its time limit after saving made progress: that is success.
            success_outcomes=(Outcome.SUCCESS.value, Outcome.TIME_LIMIT.value),
            result_file=SEGMENT_RESULT, **kwargs)
        self.campaign = campaign
        self._queued: tuple[JobRequest, int, int] | None = None  # request, train_iters, allowed
        # What the job is depends on the cluster (manifest, history, shipped code): checked
        # here as the first segment would render it, with stand-ins for those.
        layout = self._layout()
        self.check_request(self.render_segment(RunInputs.stand_in(campaign, layout), [], None))

    def _layout(self) -> Layout:
        return Layout.for_campaign(self.campaign)

    def render_segment(self, inputs: RunInputs, history: list[dict],
                       train_iters: int | None) -> JobRequest:
        """This segment's job for ``inputs`` after ``history`` (earlier segment.json's)."""
        return segment_request(self.campaign, self._layout(), inputs, history, train_iters)

    def _inputs(self, layout: Layout, manifest: dict | None) -> RunInputs:
        """The data stage's prefixes (from the pinned manifest), its tokenizer's directory."""
        from jobscripts import manifest as manifests

        prefixes = manifests.data_prefixes(manifest, layout.tokens) if manifest else None
        return RunInputs.of(prefixes, layout.tokenizer)

    def _require_data(self, data_path: list[str], origin: str | None) -> None:
        """Fail before any sbatch when a prefix to train on lacks its .bin/.idx on the
        cluster: the job would otherwise die minutes in, after its queue wait. Retrying
        cannot create the data, so no retry either."""
        from jobscripts.blend import missing_prefixes

        data = self.campaign.data
        if data.blend is not None and origin is None:
            entries = list(zip(data_path[::2], data_path[1::2], strict=True))
            fields = {b.prefix: f"data.blend[{i}].prefix" for i, b in enumerate(data.blend)}
        else:
            entries = [(1, p) for p in data_path]
            fields = {p: origin or f"data.prefixes[{i}]" for i, p in enumerate(data_path)}
        absent = set(missing_files(self.hook, [p + s for _w, p in entries
                                               for s in (".bin", ".idx")]))
        missing = missing_prefixes(entries, exists=lambda path: path not in absent)
        if missing:
            raise AirflowFailException(
                "training data missing on the cluster, nothing submitted (a Megatron prefix "
                "needs a readable <prefix>.bin and <prefix>.idx): " + "; ".join(
                    f"{fields[p]} {p}: no " + " or ".join(
                        f for f in (p + ".bin", p + ".idx") if f in absent) for p in missing))

    def prepare_job(self, context: Context) -> JobRequest:
        from dataclasses import replace

        params = context["params"]
        allowed = int(params.get("segments_per_run") or self.campaign.segments.max_per_run)
        if self.segment > allowed:
            raise AirflowSkipException(f"segment {self.segment} of this run: the run may submit "
                                       f"{allowed} (segments_per_run)")
        layout = self._layout()
        train_iters = int(params.get("train_iters") or self.campaign.training.train_iters)
        before = read_iteration(self.hook, layout)
        if before >= train_iters and not self._prequeued_job(context):
            raise AirflowSkipException(f"campaign done: checkpoint at iteration {before} "
                                       f">= train_iters {train_iters}")
        try:
            manifest = pin_manifest(self.hook, layout)
        except ValueError as exc:  # ManifestError: retrying cannot make the data match
            raise AirflowFailException(str(exc)) from exc
        history = read_history(self.hook, layout)
        inputs = self._inputs(layout, manifest)
        self._require_data(data_path(self.campaign, inputs),
                           "the dataset manifest" if manifest is not None else None)
        code_dir = self.ship_code()  # the DAG's own jobscripts, on PYTHONPATH
        inputs = replace(inputs, code_dir=code_dir)
        request = with_code(self.render_segment(inputs, history, train_iters), code_dir)
        request = replace(request, watchers=segment_watchers(self.campaign, history, before))
        context["ti"].xcom_push(key=XCOM_START, value=before)
        self._queued = (request, train_iters, allowed)
        self.log.info("segment %s resumes at iteration %s of %s", self.segment, before,
                      train_iters)
        if params.get("dry_run"):
            run_dir = self.hook.run_dir(self.job_key(context))
            self.hook.upload(run_dir, dict(request.files))
            raise AirflowSkipException(f"dry run: configs rendered and uploaded to {run_dir}")
        return request

    def _prequeued_job(self, context: Context) -> bool:
        """Whether this segment's job is already queued, ran or runs (pre-queued by an
        earlier segment): then a checkpoint at ``train_iters`` is that job's work, and this
        task re-attaches to it rather than skip."""
        if self.campaign.segments.prequeue_depth == 0:
            return False
        found = self.hook.find_by_key(self.job_key(context))
        return found is not None and classify(found.state) in KEEP

    def _segment_tasks(self, context: Context) -> dict[int, TrainingSegmentOperator]:
        return {t.segment: t for t in context["dag"].tasks
                if isinstance(t, TrainingSegmentOperator)}

    def on_job_found(self, context: Context, record: JobRecord) -> None:
        ti = context["ti"]
        depth = self.campaign.segments.prequeue_depth
        earlier = [t.task_id for n, t in self._segment_tasks(context).items()
                   if self.segment - depth <= n < self.segment]
        queued = [p for value in (ti.xcom_pull(task_ids=earlier, key=prequeue.XCOM_PREQUEUED)
                                  if earlier else None) or [] for p in (value or [])]
        mine = [p for p in queued if p["job_id"] == record.job_id]
        if mine:
            self.log.info("segment %s: re-attached to Slurm job %s (%s), which segment %s's "
                          "task pre-queued (%s)", self.segment, record.job_id, record.state,
                          mine[0]["by_segment"], prequeue.dependency(mine[0]["after_job"]))
            ti.xcom_push(key=XCOM_ATTACHED, value=record.job_id)
        if depth and self._queued is not None and classify(record.state) is Outcome.ACTIVE:
            self._prequeue(context, record, depth)

    def _prequeue(self, context: Context, record: JobRecord, depth: int) -> None:
        """Queue the next segments' jobs behind this one (prequeue.py). A failure here costs
        only the head start: each of those tasks submits its own job when it runs."""
        from operators.slurm.errors import ClusterUnreachable, SlurmCommandError

        request, train_iters, allowed = self._queued
        ti = context["ti"]
        before = ti.xcom_pull(task_ids=self.task_id, key=XCOM_START) or 0
        tasks = self._segment_tasks(context)
        after_job, after_key = record.job_id, self.job_key(context)
        checkpoints = posixpath.dirname(self._layout().tracker)
        done: list[prequeue.Prequeued] = []
        try:
            for n in prequeue.successors(self.campaign, self.segment, before, train_iters,
                                         allowed, depth):
                if n not in tasks:
                    break
                key = job_key(ti.dag_id, ti.run_id, tasks[n].task_id, ti.map_index, n)
                found = self.hook.find_by_key(key)
                if found is not None and classify(found.state) in KEEP \
                        and self._queued_behind(found, key, after_job):
                    job_id = found.job_id  # queued already (by an earlier try, or segment)
                else:
                    job = prequeue.gated(request, after_job, self.hook.run_dir(after_key),
                                         checkpoints, train_iters)
                    run_dir = self.hook.run_dir(key)
                    spec = build_spec(key, run_dir, job.command, job.job, {
                        PYTHON_ENV: self.hook.settings.remote_python, **job.environment})
                    self.hook.check(prequeue.clear_result(run_dir))
                    job_id = self.hook.submit(spec, run_dir, dict(job.files))
                done.append(prequeue.Prequeued(n, key, job_id, after_job, self.segment))
                after_job, after_key = job_id, key
        except (ClusterUnreachable, SlurmCommandError) as exc:
            self.log.warning("pre-queueing after segment %s stopped: %s (the next segment "
                             "tasks submit their own jobs)", self.segment, exc)
        ti.xcom_push(key=prequeue.XCOM_PREQUEUED, value=[p.to_json() for p in done])
        self.log.info("segment %s (job %s): pre-queued %s", self.segment, record.job_id,
                      prequeue.describe(done))

    def _queued_behind(self, found: JobRecord, key: str, after_job: str) -> bool:
        """Whether ``found``, the job under a successor's key, is this chain's: one that
        still pends must wait for ``after_job`` (prequeue.waits_for); one that left the queue
        is past its dependency."""
        from operators.slurm.hook import SCRIPT_NAME

        if found.state != "PENDING":
            return True
        script = self.hook.read_bytes(posixpath.join(self.hook.run_dir(key), SCRIPT_NAME))
        return prequeue.waits_for(script.decode(errors="replace"), after_job)

    def cancel_prequeued(self, context: Context, why: str) -> None:
        """Cancel the jobs this task queued behind its own (XCom): its job ended in a way the
        campaign does not go on from (a failure, a watcher's stop, no progress) but Slurm may
        still start them, e.g. after a job that a watchdog's SIGTERM let end COMPLETED. The
        retry of this segment queues them afresh."""
        from operators.slurm.errors import ClusterUnreachable, SlurmCommandError

        queued = context["ti"].xcom_pull(task_ids=self.task_id,
                                         key=prequeue.XCOM_PREQUEUED) or []
        for job in queued:
            try:
                self.hook.cancel(job["job_id"])
            except (ClusterUnreachable, SlurmCommandError) as exc:  # the gate still refuses
                self.log.warning("could not cancel pre-queued job %s: %s", job["job_id"], exc)
                continue
            self.log.warning("cancelled pre-queued segment %s (job %s): %s", job["segment"],
                             job["job_id"], why)

    def _job_entry(self, context: Context, summary: JobSummary) -> dict[str, Any]:
        """A segment job's record: what goodput_log.py reads back, plus which task and segment
        of which DAG run it was (for people reading the file)."""
        return {"slurm": summary.record.to_json(), "run_dir": summary.run_dir,
                "log_path": summary.log_path, "run_id": context["ti"].run_id,
                "task_id": self.task_id, "segment": self.segment}

    def _record_failed_job(self, context: Context, summary: JobSummary) -> None:
        """A failed segment job's allocation and lost work still count against the campaign's
        goodput: recorded apart from ``segments.jsonl`` (what resumes read), marked ``hung``
        when the hang watchdog stopped it. Never in the way of the failure itself."""
        from operators.campaign.adapters.remote import append_record
        from operators.slurm.errors import ClusterUnreachable, SlurmCommandError
        from operators.tracking.hang import CODE as HANG

        entry = {**self._job_entry(context, summary),
                 "hung": any(f.code == HANG for f in summary.findings)}
        try:
            append_record(self.hook, self._layout().failed_segments_log, entry)
        except (ClusterUnreachable, SlurmCommandError) as exc:
            self.log.warning("segment %s: failed job %s not recorded for goodput: %s",
                             self.segment, summary.job_id, exc)

    def _track(self, context: Context, layout: Layout, summary: JobSummary) -> None:
        """MLflow gets the segment; a tracking failure must not fail the training."""
        from operators.campaign.adapters.tracking import track_segment

        try:
            track_segment(self.campaign, self.hook, layout, context, summary,
                          self._rendered_files(summary.run_dir))
        except Exception:  # noqa: BLE001 - logged, the spool keeps what it can
            self.log.exception("tracking segment %s in MLflow failed", self.segment)

    def _rendered_files(self, run_dir: str) -> dict[str, str]:
        from operators.campaign.render import bridge, reference
        from operators.slurm.hook import SCRIPT_NAME  # paramiko: not at DAG parse

        names = (reference.CONFIG_FILE, bridge.CONFIG_FILE, SCRIPT_NAME)
        found = {n: self.hook.read_bytes(f"{run_dir}/{n}").decode() for n in names}
        return {n: text for n, text in found.items() if text}

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        result = summary.result or {}
        if failure is not None:  # neither success nor time limit: the task fails, may retry
            self._record_failed_job(context, summary)
            if result.get("stop_reason") == PREQUEUE_REFUSED:
                from jobscripts.segment_gate import EXIT_REFUSED
                from operators.slurm.errors import SlurmJobFailed

                raise SlurmJobFailed(
                    f"segment {self.segment}: Slurm job {summary.job_id} was pre-queued and "
                    f"refused to train at its start ({prequeue.GATE_MODULE}, exit code "
                    f"{EXIT_REFUSED}, stop_reason {PREQUEUE_REFUSED}): "
                    f"{result.get('stop_detail')}. Nothing was trained; a retry of this task "
                    "submits its own job.")
            self.cancel_prequeued(context, f"segment {self.segment} failed")
            return
        layout = self._layout()
        ti = context["ti"]
        before = ti.xcom_pull(task_ids=self.task_id, key=XCOM_START) or 0
        start = result.get("start_iteration")
        if isinstance(start, int) and not isinstance(start, bool):
            # The job's own record of where it resumed. The tracker this task read may be past
            # it: a pre-queued job trained before its task read it (Airflow was down), or this
            # is a retry that re-attached to its job after the next segment's job had saved
            # (seen in CI's lanes: "went backwards: iteration 8 -> 4").
            before = start
        # Progress counts to the last iteration saved (not the last trained: a crash between
        # saves trained steps that are lost): the job's segment.json against the tracker.
        end = segment_end(result.get("end_iteration"), read_iteration(self.hook, layout))
        if end.note:
            self.log.warning("segment %s: %s", self.segment, end.note)
        after = end.iteration
        append_history(self.hook, layout, {**result, **self._job_entry(context, summary)})
        self._track(context, layout, summary)
        try:
            advanced = check_progress(before, after)
        except SegmentNoProgress as exc:  # a retry would loop on the same wall
            self.cancel_prequeued(context, str(exc))
            raise AirflowFailException(str(exc)) from exc
        self.log.info("segment %s trained iterations %s -> %s (+%s), stopped: %s",
                      self.segment, before, after, advanced, result.get("stop_reason"))
