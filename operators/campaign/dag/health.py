"""A campaign's training segment with the health settings (docs/health.md).

``HealthSegmentOperator`` is the factory's segment operator when the campaign has a
``health`` section in use. On top of the plain segment (and of announcing its checkpoint for
evaluation, operators/campaign/dag/eval_dag.py) it:

- refuses to train while the campaign is held (``<campaign>/health/hold.json``), without
  retry, naming the finding: the campaign stops before its next segment;
- adds the loss-spike watcher (operators/tracking/health.py) to the segment's log watchers,
  from ``health.loss_spike``;
- when the watcher flagged the segment, writes the hold (the finding, the losses around it,
  the checkpoints on the cluster) and cancels the segments pre-queued behind it
  (docs/prequeue.md), which would otherwise start on ``afterok``;
- once a segment no watcher flagged has taken the campaign past a rollback's spike,
  removes that rollback's set-aside checkpoints (adapters/health_state.py);
- after a rollback, renders the batches to skip (``health/skip.json``) into the trainer's
  config: ``iterations_to_skip`` for the reference trainer, ``train.iterations_to_skip`` in
  Megatron Bridge's YAML (each with its own numbering, adapters/health_state.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from operators.campaign.adapters import health_state
from operators.campaign.dag.eval_dag import AnnouncingSegmentOperator
from operators.tracking.health import CODES, LossSpikeWatch, losses_of

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.render.paths import RunInputs
    from operators.campaign.schema.config import Campaign
    from operators.slurm.errors import SlurmJobFailed
    from operators.slurm.messages import JobRequest, JobSummary

GRACE_S = 120.0  # SIGTERM -> scancel when the running segment is stopped: time for a save


def uses_health(campaign: Campaign) -> bool:
    h = campaign.health
    return h.evaluate_checkpoints or h.loss_spike is not None


def with_skips(request: JobRequest, skips: list[int], bridge: bool) -> JobRequest:
    """``request`` whose trainer config skips ``skips`` (see adapters/health_state.py)."""
    if not skips:
        return request
    files = dict(request.files)
    if bridge:
        import yaml

        from operators.campaign.render.bridge import CONFIG_FILE

        tree = yaml.safe_load(files[CONFIG_FILE])
        tree.setdefault("train", {})["iterations_to_skip"] = skips
        files[CONFIG_FILE] = yaml.safe_dump(tree, sort_keys=False)
    else:
        from operators.campaign.render.reference import CONFIG_FILE

        config = json.loads(files[CONFIG_FILE])
        config["iterations_to_skip"] = skips
        files[CONFIG_FILE] = json.dumps(config, indent=2, sort_keys=True)
    return replace(request, files=files)


class HealthSegmentOperator(AnnouncingSegmentOperator):
    """A training segment that obeys the campaign's hold and watches its loss."""

    def render_segment(self, inputs: RunInputs, history: list[dict],
                       train_iters: int | None) -> JobRequest:
        request = super().render_segment(inputs, history, train_iters)
        skip = getattr(self, "_skip", None)  # read in prepare_job (none at DAG parse)
        return with_skips(request, health_state.skip_list(skip, self._bridge()), self._bridge())

    def _bridge(self) -> bool:
        return self.campaign.model.reference is None

    def prepare_job(self, context: Context) -> JobRequest:
        layout = self._layout()
        hold = health_state.read_hold(self.hook, layout)
        if hold is not None:
            raise AirflowFailException(
                f"campaign held since segment {hold.get('segment')} of run {hold.get('run_id')}: "
                f"{hold.get('reason')}; nothing submitted. Decide (continue, roll back, stop) "
                f"and clear {health_state.hold_path(layout)} (docs/health.md)")
        self._skip = health_state.read_skip(self.hook, layout)
        request = super().prepare_job(context)
        spike = self.campaign.health.loss_spike
        if spike is None:
            return request
        watcher = LossSpikeWatch.spec(spike.factor, spike.window, spike.nan_steps,
                                      spike.stop_running, GRACE_S,
                                      health_state.loss_baseline(self.hook, layout,
                                                                 spike.window))
        return replace(request, watchers=(*request.watchers, watcher))

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        flagged = [f for f in summary.findings if f.code in CODES] or self._read_log(summary)
        if flagged:
            self._hold(context, flagged[0])
        super().on_job_end(context, summary, failure)  # raises when nothing advanced
        if not flagged and failure is None:
            self._remove_passed(context)

    def _remove_passed(self, context: Context) -> None:
        """A segment no watcher flagged advanced the campaign: the set-aside checkpoints of
        any rollback whose spike it has now passed are removed (docs/health.md)."""
        from operators.campaign.adapters.remote import read_iteration

        layout = self._layout()
        iteration = read_iteration(self.hook, layout)
        for gone in health_state.remove_passed(self.hook, layout, iteration,
                                               run_id=context["ti"].run_id,
                                               segment=self.segment):
            self.log.info("set-aside checkpoints %s of the rollback to %s removed (%s): the "
                          "campaign passed the spike at %s, now at %s", gone["checkpoints"],
                          gone["rolled_back_to"], gone["set_aside_dir"],
                          gone["spike_iteration"], iteration)

    def _read_log(self, summary: JobSummary) -> list:
        """The spike watcher over the whole job log: the trigger ticks its watchers only while
        the job runs, so a spike in the lines it drains after the job's end (a segment's last
        iterations) reaches the task unjudged."""
        import time

        from jobscripts.vocabulary import TRAIN
        from operators.slurm.watch import LogWatch, Tick
        from operators.tracking.logparse import parse_lines

        spike = self.campaign.health.loss_spike
        if spike is None or not summary.log_path:
            return []
        text = self.hook.read_bytes(summary.log_path, 0, 256 << 20).decode("utf-8", "replace")
        lines = text.splitlines()
        # The baseline the segment's trigger started from: the losses before its first
        # iteration (the campaign's tracker has moved on by now).
        first = next((r.iteration for r in parse_lines(lines)
                      if r.kind == TRAIN and r.iteration is not None), None)
        baseline = [] if first is None else health_state.loss_baseline(
            self.hook, self._layout(), spike.window, up_to=first - 1)
        watch = LogWatch((LossSpikeWatch.spec(spike.factor, spike.window, spike.nan_steps,
                                              False, GRACE_S, baseline),))
        watch.feed(lines)
        watch.tick(Tick(time.time(), True))
        return [f for f in watch.findings if f.code in CODES]

    def _hold(self, context: Context, finding: Any) -> None:
        from operators.campaign.dag import prequeue

        layout, ti = self._layout(), context["ti"]
        hold = {"code": finding.code, "reason": finding.reason, "iteration": finding.iteration,
                "losses": losses_of(finding.detail), "segment": self.segment,
                "run_id": ti.run_id, "task_id": self.task_id, "at": finding.at,
                "checkpoints": health_state.complete_checkpoints(self.hook, layout)}
        health_state.write_hold(self.hook, layout, hold)
        self.log.warning("campaign held: %s (%s)", finding.reason,
                         health_state.hold_path(layout))
        queued = ti.xcom_pull(task_ids=self.task_id, key=prequeue.XCOM_PREQUEUED) or []
        for job in queued:  # they would start on afterok once this job ends well
            try:
                self.hook.cancel(job["job_id"])
                self.log.warning("cancelled pre-queued segment %s (job %s): campaign held",
                                 job["segment"], job["job_id"])
            except Exception:  # noqa: BLE001 - its own task refuses to run anyway (the hold)
                self.log.exception("could not cancel pre-queued job %s", job["job_id"])


# -- the human's decision ------------------------------------------------------------------
CONTINUE, ROLLBACK, STOP = "continue", "roll back", "stop"
DECIDE_TASK, APPLY_TASK, RESUME_TASK = "decide", "apply", "resume"


def decision_body(hold: dict[str, Any]) -> str:
    """The form's text: the finding, the losses around it, the checkpoints. Pure."""
    rows = "\n".join(f"| {i} | {loss:.6g} |{' <- flagged' if i == hold.get('iteration') else ''}"
                     for i, loss in hold.get("losses") or [])
    before = [i for i in hold.get("checkpoints") or [] if i < (hold.get("iteration") or 0)]
    return (f"**{hold.get('reason')}** (segment {hold.get('segment')}, DAG run "
            f"{hold.get('run_id')}).\n\n| iteration | lm loss |\n|---|---|\n{rows}\n\n"
            f"Complete checkpoints on the cluster: {hold.get('checkpoints')}; before the "
            f"finding: {before}.\n\n*continue*: train on from the current checkpoint; "
            f"*roll back*: to `checkpoint` (one of those before the finding), skipping the "
            f"next `skip_batches` batches; *stop*: the campaign stays held.")


def _decide_operator():
    from airflow.providers.standard.operators.hitl import HITLOperator

    class HealthDecision(HITLOperator):
        """The human's form; skips when the campaign is not held."""

        def __init__(self, *, campaign: Campaign, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.campaign = campaign

        def execute(self, context: Context):
            from airflow.sdk.exceptions import AirflowSkipException

            from operators.campaign.render.layout import Layout
            from operators.slurm.hook import SlurmHook

            hold = health_state.read_hold(SlurmHook(self.campaign.cluster.ssh_conn_id),
                                          Layout.for_campaign(self.campaign))
            if hold is None or hold.get("decision"):
                raise AirflowSkipException("the campaign is not held: nothing to decide")
            self.body = decision_body(hold)
            before = [i for i in hold.get("checkpoints") or [] if i < (hold["iteration"] or 0)]
            if before:  # the default rollback target: the last checkpoint before the finding
                self.params["checkpoint"] = before[-1]
            return super().execute(context)

    return HealthDecision


def health_decision(campaign: Campaign, dag_id: str) -> list:
    """``health.decide -> health.apply -> health.resume`` after the training segments: the
    HITL form when a segment held the campaign, then the decision carried out (a rollback
    for real) and, unless stopped, a new run of the campaign DAG."""
    from datetime import timedelta

    from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
    from airflow.sdk import Param, TaskGroup, task

    spike = campaign.health.loss_spike
    default = CONTINUE if spike.default_action == "continue" else STOP
    with TaskGroup("health") as group:
        decide = _decide_operator()(
            task_id=DECIDE_TASK, campaign=campaign, trigger_rule="all_done",
            subject=f"{campaign.name}: loss spike or NaN steps - continue, roll back or stop?",
            options=[CONTINUE, ROLLBACK, STOP], defaults=[default],
            response_timeout=timedelta(minutes=spike.decision_timeout_min),
            params={"checkpoint": Param(None, type=["null", "integer"], minimum=0,
                                        description="roll back: the checkpoint to resume from"),
                    "skip_batches": Param(0, type="integer", minimum=0,
                                          description="roll back: batches to skip after it")})

        @task(task_id=APPLY_TASK)
        def apply(ti=None) -> dict:
            """The decision, carried out on the cluster; the hold kept with it."""
            from airflow.sdk.exceptions import AirflowSkipException

            from operators.campaign.render.layout import Layout
            from operators.slurm.hook import SlurmHook

            answer = ti.xcom_pull(task_ids=f"health.{DECIDE_TASK}") or {}
            chosen = (answer.get("chosen_options") or [default])[0]
            given = answer.get("params_input") or {}
            hook, layout = SlurmHook(campaign.cluster.ssh_conn_id), Layout.for_campaign(campaign)
            decision = {"action": chosen, "by": answer.get("responded_by_user"),
                        "params": given, "run_id": ti.run_id}
            if chosen == ROLLBACK:
                if given.get("checkpoint") is None:
                    raise AirflowFailException("roll back: no checkpoint chosen")
                held = health_state.read_hold(hook, layout) or {}
                decision["rollback"] = health_state.rollback(
                    hook, layout, int(given["checkpoint"]), int(given.get("skip_batches") or 0),
                    spike_iteration=held.get("iteration"))
            if chosen == STOP:
                hold = health_state.read_hold(hook, layout) or {}
                health_state.write_hold(hook, layout, {**hold, "decision": decision})
                raise AirflowSkipException("stopped: the campaign stays held "
                                           f"({health_state.hold_path(layout)})")
            health_state.clear_hold(hook, layout, decision)
            return decision

        resume = TriggerDagRunOperator(task_id=RESUME_TASK, trigger_dag_id=dag_id)
        decide >> apply() >> resume
    return [group]
