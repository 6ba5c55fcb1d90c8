"""Every checkpoint evaluated as it lands: the campaign's checkpoints as an Asset, and the
evaluation DAG ``pretrain__<name>__eval`` scheduled on it (docs/health.md).

    pretrain__<name>:        ... train.segment_i --(asset event, extra {"iteration": N})--> ...
    pretrain__<name>__eval:  pending -> export -> evaluate

With ``health.evaluate_checkpoints`` each segment that leaves a new complete checkpoint (its
task succeeds: the tracker advanced) emits an event for the asset ``<name>-checkpoints`` with
the iteration it saved in its extra. The evaluation DAG runs on that asset, in its own pool
(``health.eval_pool``), so a training segment never waits for it. It allows several runs at
once: with ``max_active_runs=1``, Airflow 3.3 leaves the events that arrive
while a run is going queued until some later event comes (apache/airflow#56050), so the last
checkpoint's was never evaluated. Each run takes the events the scheduler handed it, and
``pending`` keeps a ledger on the cluster (``<campaign>/checkpoint_evals/ledger.jsonl``:
announced by run R, evaluated, skipped), so each checkpoint is evaluated once: a run claims
what its events announced and what a run that ended without evaluating it had claimed, never
what another live run holds; one that retention removed first is logged and recorded as
skipped.

The final ``evaluate`` of the campaign DAG reuses the evaluation of the last checkpoint when
this DAG already wrote it (:class:`ReusingEvaluateOperator`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow.sdk import DAG, Asset, task

from operators.campaign.adapters.code_ship import CampaignJobOperator, with_code
from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.dag.stage_operator import CampaignStageOperator
from operators.campaign.render import checkpoint_eval as render
from operators.campaign.render.layout import RESULT_FILE, Layout
from operators.campaign.schema.naming import dag_id

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.errors import SlurmJobFailed
    from operators.slurm.messages import JobRequest, JobSummary

EVAL_DAG_SUFFIX = "__eval"
ITERATION_KEY = "iteration"  # the asset event's extra: the checkpoint's iteration
ANNOUNCED, EVALUATED, SKIPPED = "announced", "evaluated", "skipped"
PENDING_TASK, EXPORT_TASK, EVALUATE_TASK = "pending", "export", "evaluate"
DEFAULT_POOL = "default_pool"
REUSE_WAIT_S = 1200  # the final evaluate waits this long for an evaluation in flight
REUSE_POLL_S = 5
# How many polls in a row must find the evaluation DAG idle (no run queued or running) before
# an announced checkpoint it never recorded counts as lost: between one run's end and the next
# run's creation it is idle for a moment.
IDLE_POLLS = 3
# The final evaluate's XCom key naming the evaluation DAG's result it reused (its eval.json).
REUSED_KEY = "reused"
# The evaluation DAG's runs at once: one per checkpoint event in flight; a campaign announces
# one per segment, so more than a few means the evaluations fall behind the training.
EVAL_MAX_ACTIVE_RUNS = 8


def checkpoints_asset(campaign: Campaign) -> Asset:
    """The campaign's checkpoints, as the Asset its segments update."""
    layout = Layout.for_campaign(campaign)
    host = campaign.cluster.ssh_conn_id.replace("_", "-")
    return Asset(uri=f"file://{host}{layout.checkpoints}", name=f"{campaign.name}-checkpoints")


def eval_dag_id(campaign: Campaign) -> str:
    return dag_id(campaign) + EVAL_DAG_SUFFIX


class AnnouncingSegmentOperator(TrainingSegmentOperator):
    """A training segment that announces the checkpoint it left (an asset event), with
    ``health.evaluate_checkpoints``."""

    def __init__(self, **kwargs: Any) -> None:
        campaign = kwargs["campaign"]
        if campaign.health.evaluate_checkpoints:
            kwargs = {**kwargs, "outlets": [checkpoints_asset(campaign)]}
        super().__init__(**kwargs)

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        super().on_job_end(context, summary, failure)  # raises when nothing advanced
        if failure is not None or not self.campaign.health.evaluate_checkpoints:
            return
        iteration = announced_iteration(summary.result, self._tracker_iteration)
        context["outlet_events"][checkpoints_asset(self.campaign)].extra = {
            ITERATION_KEY: iteration, "segment": self.segment, "run_id": context["ti"].run_id}
        self.log.info("checkpoint %s announced for evaluation", iteration)

    def _tracker_iteration(self) -> int:
        from operators.campaign.adapters.remote import read_iteration

        return read_iteration(self.hook, self._layout())


def announced_iteration(result: dict | None, tracker: Callable[[], int]) -> int:
    """The checkpoint a segment left: its own result's ``end_iteration`` (the last iteration it
    saved), not the tracker as it is when the task ends: with pre-queueing the next segment's
    job starts the moment this one ends and may have saved past it before this task reads the
    tracker (seen: segment 1 of 2-iteration segments announced 4, and checkpoint 2 was never
    evaluated). The tracker only when the result has no iteration. Pure but for ``tracker``."""
    end = (result or {}).get("end_iteration")
    if isinstance(end, int) and not isinstance(end, bool) and end > 0:
        return end
    return tracker()


# -- the ledger ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LedgerEntry:
    """An iteration's latest line in the ledger: its state and the run that wrote it."""

    state: str
    run_id: str | None = None


def read_entries(text: str | None) -> dict[int, LedgerEntry]:
    """iteration -> its latest entry. Pure."""
    entries: dict[int, LedgerEntry] = {}
    for line in (text or "").splitlines():
        if line.strip():
            entry = json.loads(line)
            entries[int(entry[ITERATION_KEY])] = LedgerEntry(entry["state"], entry.get("run_id"))
    return entries


def read_ledger(text: str | None) -> dict[int, str]:
    """iteration -> its latest state (announced, evaluated, skipped). Pure."""
    return {i: e.state for i, e in read_entries(text).items()}


def ledger_lines(entries: list[tuple[int, str]], **extra: Any) -> str:
    return "".join(json.dumps({ITERATION_KEY: i, "state": s, **extra}, sort_keys=True) + "\n"
                   for i, s in entries)


def to_evaluate(states: dict[int, str]) -> list[int]:
    """Announced and neither evaluated nor skipped yet, oldest first. Pure."""
    return sorted(i for i, s in states.items() if s == ANNOUNCED)


def claims(entries: dict[int, LedgerEntry], announced: set[int], run_id: str,
           live: Callable[[str], bool]) -> tuple[list[int], list[int]]:
    """(what run ``run_id`` must write as claimed by it, everything it evaluates), oldest
    first. It evaluates what its own events announced, unless the ledger has it evaluated,
    skipped or claimed by another live run (a duplicate event); and what a run no longer
    ``live`` claimed and never evaluated (a failed run's). Its own claims (a retry of
    ``pending`` in the same run) stay its own. Pure but for ``live``, asked only of other
    runs' claims."""
    open_claims = to_evaluate({i: e.state for i, e in entries.items()})
    orphans = [i for i in open_claims if entries[i].run_id != run_id
               and (entries[i].run_id is None or not live(entries[i].run_id))]
    take = sorted({*(announced - entries.keys()), *orphans})
    mine = sorted({*take, *(i for i in open_claims if entries[i].run_id == run_id)})
    return take, mine


def _append_ledger(hook, layout: Layout, entries: list[tuple[int, str]], **extra: Any) -> None:
    """Appends, in one ``>>`` of a few hundred bytes: the evaluation DAG's runs may write at
    once, and an O_APPEND write this small is not interleaved with another."""
    import shlex

    if entries:
        path = render.ledger_path(layout)
        hook.check(f"mkdir -p -- {shlex.quote(posixpath.dirname(path))} && printf '%s' "
                   f"{shlex.quote(ledger_lines(entries, **extra))} >> {shlex.quote(path)}")


def _pending_task(campaign: Campaign):
    asset = checkpoints_asset(campaign)

    @task(task_id=PENDING_TASK)
    def pending(triggering_asset_events=None, ti=None) -> list[int]:
        """The checkpoints this run evaluates: those its events announced, and any announced
        earlier that no run evaluated yet (a failed run's). One removed by retention is
        recorded as skipped."""
        import logging

        from airflow.sdk.exceptions import AirflowSkipException

        from jobscripts import checkpoints
        from operators.campaign.adapters.remote import missing_files, read_text
        from operators.slurm.hook import SlurmHook

        log = logging.getLogger(__name__)
        hook, layout = SlurmHook(campaign.cluster.ssh_conn_id), Layout.for_campaign(campaign)
        events = list((triggering_asset_events or {}).get(asset, []))
        entries = read_entries(read_text(hook, render.ledger_path(layout)))
        announced = {int(e.extra[ITERATION_KEY]) for e in events
                     if ITERATION_KEY in (e.extra or {})}
        log.info("checkpoints announced by this run's %d event(s): %s", len(events),
                 sorted(announced))

        def live(run_id: str) -> bool:  # another run of this DAG that may still evaluate
            return ti.get_dagrun_state(ti.dag_id, run_id) in ("queued", "running")

        take, wanted = claims(entries, announced, ti.run_id, live)
        if set(take) - announced:
            log.info("checkpoints %s: claimed by runs that ended without evaluating them",
                     sorted(set(take) - announced))
        _append_ledger(hook, layout, [(i, ANNOUNCED) for i in take], run_id=ti.run_id)
        dirs = {i: checkpoints.checkpoint_dir(layout.checkpoints, i).as_posix() for i in wanted}
        gone = set(missing_files(hook, list(dirs.values())))
        skipped = [i for i in wanted if dirs[i] in gone]
        for i in skipped:
            log.warning("checkpoint %s skipped: retention removed %s before its evaluation",
                        i, dirs[i])
        _append_ledger(hook, layout, [(i, SKIPPED) for i in skipped], run_id=ti.run_id,
                       reason="removed by retention before its evaluation")
        left = [i for i in wanted if i not in skipped]
        if not left:
            raise AirflowSkipException(f"no checkpoint to evaluate (skipped: {skipped})")
        return left

    return pending()


class _CheckpointJob(CampaignJobOperator):
    """One of the evaluation DAG's two jobs over the checkpoints ``pending`` chose."""

    def __init__(self, *, campaign: Campaign, backend: str = "vllm", **kwargs: Any) -> None:
        super().__init__(campaign=campaign, result_file=RESULT_FILE, **kwargs)
        self.backend = backend
        # Rendered when the task runs: checked here with a stand-in checkpoint.
        self.check_request(self.render(Layout.for_campaign(campaign), [1]))

    def render(self, layout: Layout, iterations: list[int]) -> JobRequest:
        raise NotImplementedError

    def iterations(self, context: Context) -> list[int]:
        return list(context["ti"].xcom_pull(task_ids=PENDING_TASK) or [])

    def prepare_job(self, context: Context) -> JobRequest:
        from airflow.sdk.exceptions import AirflowSkipException

        iterations = self.iterations(context)
        if not iterations:
            raise AirflowSkipException("no checkpoint left to evaluate")
        request = self.render(Layout.for_campaign(self.campaign), iterations)
        return with_code(request, self.ship_code())


class CheckpointExportOperator(_CheckpointJob):
    def render(self, layout: Layout, iterations: list[int]) -> JobRequest:
        return render.export_request(self.campaign, layout, iterations)

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        skipped = list((summary.result or {}).get("skipped") or [])
        if skipped:
            self.log.warning("checkpoints %s skipped: retention removed them before export",
                             skipped)
            _append_ledger(self.hook, Layout.for_campaign(self.campaign),
                           [(i, SKIPPED) for i in skipped], run_id=context["ti"].run_id,
                           reason="removed by retention before its export")


class CheckpointEvaluateOperator(_CheckpointJob):
    def render(self, layout: Layout, iterations: list[int]) -> JobRequest:
        return render.evaluate_request(self.campaign, layout, iterations, self.backend)

    def iterations(self, context: Context) -> list[int]:
        exported = context["ti"].xcom_pull(task_ids=EXPORT_TASK) or {}
        return sorted(int(i) for i, r in ((exported.get("result") or {}).get("checkpoints")
                                          or {}).items() if r.get("ok"))

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        from operators.campaign.adapters.checkpoint_eval_log import log_checkpoint_evals

        layout = Layout.for_campaign(self.campaign)
        done = [int(i) for i, r in ((summary.result or {}).get("checkpoints") or {}).items()
                if r.get("ok")]
        _append_ledger(self.hook, layout, [(i, EVALUATED) for i in sorted(done)],
                       run_id=context["ti"].run_id)
        try:
            log_checkpoint_evals(self.campaign, self.hook, layout, context, summary,
                                 "FAILED" if failure is not None else "FINISHED")
        except Exception:  # noqa: BLE001 - tracking never changes the evaluation's outcome
            self.log.exception("tracking the checkpoint evaluations in MLflow failed")


def build_eval_dag(campaign: Campaign, start_date: datetime, *, backend: str = "vllm",
                   auto_register: bool = True) -> DAG:
    """``pretrain__<name>__eval``, scheduled on the campaign's checkpoints. ``backend``: the
    one the campaign's final evaluate uses (vllm); transformers for a CPU-only cross-check."""
    pool = campaign.health.eval_pool or DEFAULT_POOL
    # Not max_active_runs=1: at that cap Airflow 3.3 strands the events that arrive during a
    # run (apache/airflow#56050). The pool bounds how many evaluation jobs run at once.
    with DAG(dag_id=eval_dag_id(campaign), schedule=[checkpoints_asset(campaign)],
             start_date=start_date, catchup=False, max_active_runs=EVAL_MAX_ACTIVE_RUNS,
             default_args={"pool": pool, "retries": 0},
             tags=["pretrain", "evaluation"], auto_register=auto_register,
             doc_md=f"Every checkpoint of `{dag_id(campaign)}` evaluated as it lands "
                    "(docs/health.md).") as dag:
        chosen = _pending_task(campaign)
        export = CheckpointExportOperator(task_id=EXPORT_TASK, campaign=campaign)
        evaluate = CheckpointEvaluateOperator(task_id=EVALUATE_TASK, campaign=campaign,
                                              backend=backend)
        chosen >> export >> evaluate
    return dag


def waiting_on_eval(state: str | None, announced: bool, idle_polls: int) -> bool:
    """Whether the final evaluate still waits for the evaluation DAG's result of a checkpoint:
    its ledger says announced (a run has it), or only its asset event announced it and the DAG
    has not been idle for IDLE_POLLS polls in a row. Pure."""
    return state == ANNOUNCED or (state is None and announced and idle_polls < IDLE_POLLS)


class ReusingEvaluateOperator(CampaignStageOperator):
    """The campaign DAG's final ``evaluate``: the evaluation DAG's result for the exported
    iteration when there is one (same data and flags), else its own job. When the evaluation
    DAG has that checkpoint in hand (an asset event announced it and its ledger does not say
    evaluated or skipped yet) this waits for it, up to ``REUSE_WAIT_S``, rather than
    evaluating the same checkpoint twice."""

    def __init__(self, **kwargs: Any) -> None:
        # The checkpoints asset as an inlet: its events say which iterations were announced,
        # also one whose evaluation run has not reached ``pending`` yet and so is not in the
        # ledger.
        super().__init__(**{**kwargs, "inlets": [checkpoints_asset(kwargs["campaign"])]})

    def _announced(self, context: Context, iteration: int) -> bool:
        try:
            events = context["inlet_events"][checkpoints_asset(self.campaign)]
            return any((e.extra or {}).get(ITERATION_KEY) == iteration
                       for e in events.ascending(False).limit(100))
        except Exception:  # noqa: BLE001 - then only the ledger says what is in flight
            self.log.exception("could not read the checkpoints asset's events")
            return False

    def _reusable(self, iteration: int, announced: bool,
                  eval_busy: Callable[[], bool]) -> tuple[dict | None, str]:
        import time

        from operators.campaign.adapters.remote import read_text

        layout = Layout.for_campaign(self.campaign)
        path = render.eval_result_path(layout, iteration)
        deadline = time.monotonic() + REUSE_WAIT_S
        idle = 0
        while True:
            found = json.loads(read_text(self.hook, path) or "{}")
            if found.get("ok"):
                return found, path
            state = read_ledger(read_text(self.hook, render.ledger_path(layout))).get(iteration)
            # Only the asset event knows the checkpoint: a run of the evaluation DAG will take
            # it while that DAG is busy. Idle for IDLE_POLLS polls, the event was dropped
            # (Airflow can merge an event that arrives during a run into nothing:
            # apache/airflow#56050), and waiting on would cost REUSE_WAIT_S for nothing.
            idle = 0 if state is not None or not announced or eval_busy() else idle + 1
            in_flight = waiting_on_eval(state, announced, idle)
            if not in_flight or time.monotonic() > deadline:
                if state is None and announced and idle >= IDLE_POLLS:
                    self.log.warning("checkpoint %s was announced but %s has no run for it "
                                     "(the event was not delivered): evaluating it here",
                                     iteration, eval_dag_id(self.campaign))
                return None, path
            self.log.info("checkpoint %s is being evaluated by %s: waiting for it", iteration,
                          eval_dag_id(self.campaign))
            time.sleep(REUSE_POLL_S)

    def _eval_busy(self, context: Context) -> bool:
        try:
            return context["ti"].get_dr_count(dag_id=eval_dag_id(self.campaign),
                                              states=["queued", "running"]) > 0
        except Exception:  # noqa: BLE001 - unknown: wait as before, up to REUSE_WAIT_S
            self.log.exception("could not count %s's active runs", eval_dag_id(self.campaign))
            return True

    def execute(self, context: Context) -> Any:
        iteration = int(context["ti"].xcom_pull(task_ids="finished") or 0)
        found, path = self._reusable(iteration, self._announced(context, iteration),
                                     lambda: self._eval_busy(context)) \
            if iteration else (None, "")
        if found is not None:
            self.log.info("checkpoint %s was evaluated by %s: reusing %s", iteration,
                          eval_dag_id(self.campaign), path)
            return {"result": found, REUSED_KEY: path}
        return super().execute(context)
