"""``TrainingSegmentOperator``: one training segment of a campaign, as one Slurm job.

Before submitting it reads the checkpoint tracker (a campaign already done
skips), pins the dataset manifest at the first segment and refuses a changed one,
and renders the run config for the reference trainer or Megatron Bridge. After
the job it reads ``segment.json`` and fails loudly when the iteration did not
advance: a segment that makes no progress must never loop.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from jobscripts.job_files import SEGMENT_RESULT
from operators.campaign.adapters.code_ship import ShipsCode, with_code
from operators.campaign.adapters.remote import (
    append_history,
    missing_files,
    read_history,
    read_iteration,
    read_text,
    write_file,
)
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs, data_path
from operators.campaign.render.plan import SegmentNoProgress, check_progress
from operators.slurm.operator import SlurmJobOperator
from operators.slurm.states import Outcome
from operators.tracking.links import MlflowRunLink

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.errors import SlurmJobFailed
    from operators.slurm.hook import SlurmHook
    from operators.slurm.messages import JobRequest, JobSummary

XCOM_START = "segment_start_iteration"


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
        if before >= train_iters:
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
        context["ti"].xcom_push(key=XCOM_START, value=before)
        self.log.info("segment %s resumes at iteration %s of %s", self.segment, before,
                      train_iters)
        if params.get("dry_run"):
            run_dir = self.hook.run_dir(self.job_key(context))
            self.hook.upload(run_dir, dict(request.files))
            raise AirflowSkipException(f"dry run: configs rendered and uploaded to {run_dir}")
        return request

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
        if failure is not None:  # neither success nor time limit: the task fails, may retry
            return
        layout = self._layout()
        before = context["ti"].xcom_pull(task_ids=self.task_id, key=XCOM_START) or 0
        result = summary.result or {}
        # Progress is what the checkpoint tracker names now: the last iteration saved, not the
        # last one trained (a crash between saves trained steps that are lost), and not a
        # segment.json that may be missing or stale.
        after = read_iteration(self.hook, layout)
        if result.get("end_iteration") not in (None, after):
            self.log.warning("segment.json says iteration %s, the checkpoint tracker %s: "
                             "counting the tracker's", result.get("end_iteration"), after)
        append_history(self.hook, layout, {**result, "slurm": summary.record.to_json(),
                                            "run_dir": summary.run_dir,
                                            "log_path": summary.log_path,
                                            "run_id": context["ti"].run_id,
                                            "task_id": self.task_id})
        self._track(context, layout, summary)
        try:
            advanced = check_progress(before, after)
        except SegmentNoProgress as exc:  # a retry would loop on the same wall
            raise AirflowFailException(str(exc)) from exc
        self.log.info("segment %s trained iterations %s -> %s (+%s), stopped: %s",
                      self.segment, before, after, advanced, result.get("stop_reason"))
