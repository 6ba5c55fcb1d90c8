"""``SlurmJobOperator``: submit (or re-attach to) one Slurm job and wait for it.

Idempotent by construction (docs/contracts.md): the job carries a key built from
the task instance but not the try number. Before ``sbatch``, and again after
any ``sbatch`` error, the operator looks the key up; a live or completed job
is re-attached, so no unit of work is submitted twice. A job that ended badly
is not re-attached by a *new* try: that try is the retry.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import time
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, literal

from operators.slurm import commands
from operators.slurm.errors import ClusterUnreachable, SlurmCommandError, SlurmJobFailed
from operators.slurm.jobkey import job_key
from operators.slurm.links import SlurmJobLink, SlurmLogLink, job_url, log_url
from operators.slurm.messages import (
    ERROR,
    TERMINAL,
    WATCHED,
    JobEvent,
    JobLocation,
    JobRequest,
    JobSummary,
    SubmittedJob,
)
from operators.slurm.parse import JobRecord
from operators.slurm.spec import ContainerSpec, JobSpec
from operators.slurm.states import COMPLETING, Outcome, SettleGate, classify
from operators.slurm.trigger import WATCH_LOG_MARK, SlurmJobTrigger
from operators.slurm.watch import LogWatch, StopStep, Tick, failure_reason

if TYPE_CHECKING:
    from airflow.sdk import Context

# Jobs name the cluster's Python through this variable, set from the connection's
# ``remote_python`` at submission: DAGs are written before anyone knows that path.
PYTHON_ENV = "PP_PYTHON"
LOG_NAME = "slurm-%j.out"
ARRAY_LOG_NAME = "slurm-%A_%a.out"  # one log per array task
XCOM_JOB = "slurm_job"
_LITERAL = type(literal(None))  # airflow.sdk's LiteralValue, without its private module path


def as_data(value: Any) -> Any:
    """``value`` as data Airflow passes on as it is, never renders (``airflow.sdk.literal``).

    For a templated field's values that come from users' files (a campaign's environment,
    partition, paths): ``'{{ conn.x.password }}'`` there must reach the job as those
    characters, not as the password. A mapping keeps its keys and wraps each value, so the
    operator still reads it as a mapping before rendering.
    """
    if isinstance(value, Mapping):
        return {k: literal(v) for k, v in value.items()}
    return literal(value)


def plain(value: Any) -> Any:
    """``value`` with :func:`as_data` undone: what Airflow's rendering turns it into."""
    if isinstance(value, _LITERAL):
        return value.value
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def build_spec(key: str, run_dir: str, command: str, job: Mapping[str, Any],
               environment: Mapping[str, str] | None = None) -> JobSpec:
    """The validated spec for one job. Raises ``JobSpecError`` naming the field."""
    job = dict(job)
    container = job.pop("container", None)
    if isinstance(container, Mapping):
        container = ContainerSpec(image=container["image"],
                                  binds=tuple(container.get("binds", ())),
                                  nv=container.get("nv", True))
    unknown = set(job) - set(JobSpec.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown job option(s): {sorted(unknown)}")
    return JobSpec(
        name=key, comment=key, command=command, workdir=run_dir,
        output=posixpath.join(run_dir, ARRAY_LOG_NAME if job.get("array") else LOG_NAME),
        environment=dict(environment or {}),
        container=container, **job,
    ).validate()


def python_module_command(module: str, *args: object) -> str:
    """``"$PP_PYTHON" -m module args...`` with every argument shell-quoted."""
    import shlex

    quoted = " ".join(shlex.quote(str(a)) for a in args)
    return f'"${PYTHON_ENV}" -m {shlex.quote(module)} {quoted}'.rstrip()


def log_path_for(spec: JobSpec, job_id: str) -> str:
    """The log to stream; for an array job, that of its first task."""
    first_task = re.match(r"[0-9]+", spec.array or "0").group(0)
    return log_pattern_for(spec, job_id).replace("%a", first_task)


def log_pattern_for(spec: JobSpec, job_id: str) -> str:
    """The job's log path with ``%a`` (an array task's id) left in: the trigger streams every
    task's log."""
    master = job_id.partition("_")[0]
    return spec.output.replace("%j", master).replace("%A", master)


class SlurmJobOperator(BaseOperator):
    """Run ``command`` as a Slurm batch job on the cluster behind ``ssh_conn_id``.

    Subclasses change what is submitted and what happens at the end only through two public
    extension points: :meth:`prepare_job` (the :class:`JobRequest` to submit, rendered when
    the task runs) and :meth:`on_job_end` (the job's :class:`JobSummary`, success or
    failure). One whose job is rendered at run time validates a stand-in rendering at parse
    time with :meth:`check_request`.

    :param command: the job's shell command (templated); None for a subclass whose
        :meth:`prepare_job` renders it.
    :param job: sbatch options: partition, account, nodes, time, gpus_per_node, ...
    :param environment: variables exported in the script (not for secrets).
    :param files: name -> content, uploaded into the job's run directory.
    :param result_file: a JSON file the job writes in its run directory; returned.
    :param success_outcomes: outcomes that count as success (a training segment
        adds ``time_limit``).
    :param wait_for_completion: False returns once the job is submitted, for chains
        built from Slurm dependencies (``afterok:<job id>``) and a sensor.
    """

    template_fields = ("command", "job", "environment", "files", "result_file")
    template_fields_renderers = {"command": "bash", "job": "json", "environment": "json"}
    operator_extra_links = (SlurmJobLink(), SlurmLogLink())
    ui_color = "#dfe8f5"

    def __init__(self, *, ssh_conn_id: str, command: str | None = None,
                 job: Mapping[str, Any] | None = None,
                 environment: Mapping[str, str] | None = None,
                 files: Mapping[str, str] | None = None, result_file: str | None = None,
                 segment: int | None = None, deferrable: bool = True,
                 poll_interval: float = 5.0, unknown_budget_s: float = 600.0,
                 success_outcomes: Collection[str] = (Outcome.SUCCESS.value,),
                 wait_for_completion: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ssh_conn_id = ssh_conn_id
        self.command = command
        self.job = dict(job or {})
        self.environment = dict(environment or {})
        self.files = dict(files or {})
        self.result_file = result_file
        self.segment = segment
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.unknown_budget_s = unknown_budget_s
        self.success_outcomes = frozenset(success_outcomes)
        self.wait_for_completion = wait_for_completion
        self._job_id: str | None = None
        self._run_dir: str | None = None
        self._killed = False  # this try's on_kill ran: a CANCELLED job is its own doing
        self._hook = None  # a SlurmHook, made on first use
        if command is not None and not _templated(self.job, self.environment, self.command):
            self.check_request(JobRequest(plain(self.command), plain(self.job),
                                          plain(self.environment)))

    @property
    def hook(self):
        if self._hook is None:
            from operators.slurm.hook import SlurmHook  # paramiko: keep DAG parsing light

            self._hook = SlurmHook(self.ssh_conn_id)
        return self._hook

    # -- submission ------------------------------------------------------------
    def job_key(self, context: Context) -> str:
        ti = context["ti"]
        return job_key(ti.dag_id, ti.run_id, ti.task_id, ti.map_index, self.segment)

    @staticmethod
    def check_request(request: JobRequest) -> None:
        """Fail at DAG parse, not on the cluster: ``request``'s spec, validated with a stand-in
        key and run dir. Raises ``JobSpecError`` naming the field."""
        build_spec("pp-parse-check", "/parse-check", request.command, request.job,
                   request.environment)

    def prepare_job(self, context: Context) -> JobRequest:
        """The job to submit (extension point): by default this operator's (rendered)
        arguments. A subclass renders its own here, before any submission; it may raise
        ``AirflowSkipException`` / ``AirflowFailException`` to submit nothing."""
        if self.command is None:
            raise ValueError(f"{self.task_id}: no command, and {type(self).__name__} renders "
                             "none in prepare_job")
        return JobRequest(self.command, self.job, self.environment, self.files,
                          self.result_file)

    def on_job_found(self, context: Context, record: JobRecord) -> None:
        """Called once this task's job is known, submitted or re-attached, before the task
        waits for it (extension point; the segment operator pre-queues the next segments
        here). ``record``: the job as squeue/sacct showed it then."""

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        """Called once the job ended and its result was read (extension point). ``failure``:
        None when the job succeeded (the task then returns ``summary``), else the error the
        task raises after this returns; this may raise a different one instead."""

    def execute(self, context: Context) -> Any:
        request = self.prepare_job(context)
        if request.result_file != self.result_file:
            # The resumed task (after deferral) reads the result by this operator's own name.
            raise ValueError(f"{self.task_id}: prepare_job's result_file "
                             f"{request.result_file!r} is not the operator's "
                             f"{self.result_file!r}")
        key = self.job_key(context)
        watch = LogWatch(tuple(request.watchers))  # a bad watcher fails here too, before SSH
        if watch and request.job.get("array"):
            raise ValueError(f"{self.task_id}: log watchers read one log; an array job has one "
                             "per task")
        # Validate before any SSH: a bad spec fails here, naming its field.
        environment = {PYTHON_ENV: self.hook.settings.remote_python, **request.environment}
        spec = build_spec(key, "/pending", request.command, request.job, environment)
        run_dir = self.hook.run_dir(key)
        spec = replace(spec, workdir=run_dir, output=posixpath.join(
            run_dir, posixpath.basename(spec.output))).validate()
        record = self._attach_or_submit(spec, run_dir, key, request.files)
        self._job_id, self._run_dir = record.job_id, run_dir
        log_path = log_path_for(spec, record.job_id)
        self._persist(context, JobLocation(record.job_id, log_path, run_dir))
        self.on_job_found(context, record)
        if not self.wait_for_completion:
            return SubmittedJob(record.job_id, record.state, run_dir, log_path).to_json()
        try:
            outcome = classify(record.state)
        except ValueError:
            outcome = Outcome.ACTIVE
        if outcome.terminal and record.source == "sacct":  # finished before we could defer
            return self._complete(context, JobEvent(TERMINAL, record.job_id,
                                                    outcome=outcome.value, record=record))
        if self.deferrable:
            result_path = posixpath.join(run_dir, self.result_file) if self.result_file else None
            self.defer(trigger=SlurmJobTrigger(
                ssh_conn_id=self.ssh_conn_id, job_id=record.job_id, log_path=log_path,
                poll_interval=self.poll_interval, unknown_budget_s=self.unknown_budget_s,
                result_path=result_path, job_name=key,
                log_pattern=log_pattern_for(spec, record.job_id) if spec.array else None,
                watch=watch.to_json() if watch else None),
                method_name="execute_complete")
        return self._complete(context, self._wait_in_worker(record.job_id, log_path, key,
                                                            watch))

    def _attach_or_submit(self, spec: JobSpec, run_dir: str, key: str,
                          files: Mapping[str, str]) -> JobRecord:
        found = self.hook.find_by_key(key)
        if found is not None:
            outcome = classify(found.state)
            # A job the log watch stopped is the failed try's, never one to re-attach to: it
            # may have saved on SIGTERM and ended COMPLETED, or still be dying (COMPLETING
            # while Slurm's KillWait runs, after a cancel it ignored SIGTERM through).
            stopped = outcome in (Outcome.ACTIVE, Outcome.SUCCESS) and self._stopped_by_watch(
                found.job_id, run_dir)
            # Nor one an earlier try's kill cancelled that is still dying (COMPLETING while
            # KillWait runs): this try's successors would be queued behind a dead job.
            dying = found.state == COMPLETING and found.job_id in self.hook.killed_jobs(
                run_dir)
            if outcome in (Outcome.ACTIVE, Outcome.SUCCESS) and not (stopped or dying):
                self.log.info("re-attaching to Slurm job %s (%s) for key %s",
                              found.job_id, found.state, key)
                return found
            self.log.info("earlier job %s for key %s ended %s%s; submitting this try's job",
                          found.job_id, key, found.state,
                          " (stopped by the log watch)" if stopped else
                          " (cancelled by an earlier try's kill)" if dying else "")
            if outcome is Outcome.RETRYABLE:
                spec = self._avoid_failed_nodes(spec, found)
        if self.result_file:
            # The run dir is the key's, shared by every try: an earlier try's result must
            # not be read as this one's when this job dies before writing its own.
            self.hook.check("rm -f -- " + shlex.quote(posixpath.join(run_dir, self.result_file)))
        try:
            job_id = self.hook.submit(spec, run_dir, dict(files))
        except (ClusterUnreachable, SlurmCommandError) as exc:
            # The sbatch may have reached Slurm before the error: look before retrying.
            again = self._lookup_quietly(key)
            if again is not None and again.job_id != (found.job_id if found else None):
                self.log.warning("sbatch reported %s but job %s exists: re-attaching",
                                 exc, again.job_id)
                return again
            raise
        self.log.info("submitted Slurm job %s (key %s, run dir %s)", job_id, key, run_dir)
        return (self.hook.describe(job_id, name=key)
                or JobRecord(job_id=job_id, name=key, state="PENDING"))

    def _stopped_by_watch(self, job_id: str, run_dir: str) -> bool:
        """Whether a log watcher stopped ``job_id`` (``commands.STOPPED_JOBS``)."""
        data = self.hook.read_bytes(posixpath.join(run_dir, commands.STOPPED_JOBS))
        return job_id in data.decode().split()

    def _avoid_failed_nodes(self, spec: JobSpec, failed: JobRecord) -> JobSpec:
        """After NODE_FAIL/PREEMPTED/BOOT_FAIL, keep the retry off the nodes that failed."""
        from operators.slurm.nodes import NO_NODES, retry_exclusions, unhealthy_nodes

        available = self.hook.node_count(spec.partition)
        unhealthy: set[str] = set()
        if failed.nodelist.strip() not in NO_NODES:
            # Which of them failed, for when the cluster cannot spare them all (one SSH
            # command, on a retry after a node failure only; unreadable: none known).
            rc, out, _ = self.hook.run(commands.sinfo_node_states(failed.nodelist.strip()))
            unhealthy = unhealthy_nodes(out) if rc == 0 else set()
        exclude = retry_exclusions(failed.nodelist, available, spec.nodes or 1, unhealthy)
        if exclude is None:
            self.log.info("retry after %s on %s: not excluding them (%s node(s) in the "
                          "partition, the job needs %s)", failed.state, failed.nodelist,
                          available, spec.nodes or 1)
            return spec
        self.log.info("retry after %s on %s: excluding those nodes", failed.state, exclude)
        return replace(spec, exclude=exclude).validate()

    def _lookup_quietly(self, key: str) -> JobRecord | None:
        try:
            return self.hook.find_by_key(key)
        except (ClusterUnreachable, SlurmCommandError):
            return None

    def _persist(self, context: Context, where: JobLocation) -> None:
        ti = context["ti"]
        settings = self.hook.settings
        ti.xcom_push(key=XCOM_JOB, value=where.to_json())
        ti.xcom_push(key=SlurmJobLink().xcom_key, value=job_url(settings, where.job_id))
        ti.xcom_push(key=SlurmLogLink().xcom_key,
                     value=log_url(settings, where.job_id, where.log_path))

    def job_location(self, context: Context) -> JobLocation | None:
        """Where this task instance's job is (pushed before it deferred), or None."""
        ti = context["ti"]
        info = ti.xcom_pull(task_ids=self.task_id, key=XCOM_JOB, map_indexes=ti.map_index)
        return JobLocation.from_json(info) if info else None

    # -- waiting in the worker (deferrable=False) -------------------------------
    def _wait_in_worker(self, job_id: str, log_path: str, key: str | None = None,
                        watch: LogWatch | None = None) -> JobEvent:
        """The trigger's wait, blocking: the same log streaming, states and log watchers
        (stopping the job through this worker's hook instead of the poller)."""
        offset, unknown_since, gate = 0, None, SettleGate()
        watch = watch or LogWatch()
        while True:
            time.sleep(self.poll_interval)
            try:
                data = self.hook.read_bytes(log_path, offset)
                cut = data.rfind(b"\n") + 1
                lines = data[:cut].decode("utf-8", "replace").splitlines()
                for line in lines:
                    self.log.info("[slurm %s] %s", job_id, line)
                watch.feed(lines)
                offset += cut
                record = self.hook.describe(job_id, name=key)  # key: not a reused id
            except (ClusterUnreachable, SlurmCommandError) as exc:
                self.log.warning("polling job %s failed: %s", job_id, exc)
                record = None
            if record is None:
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > self.unknown_budget_s:
                    return JobEvent(ERROR, job_id,
                                    message=f"job {job_id} state unknown past the budget")
                continue
            unknown_since = None
            outcome = classify(record.state)
            if watch and not outcome.terminal:
                self._run_watchers_here(watch, job_id, posixpath.dirname(log_path),
                                        record.state == "RUNNING")
                if watch.ends_wait:
                    return JobEvent(WATCHED, job_id, outcome=outcome.value, record=record,
                                    findings=tuple(watch.findings))
            if gate.final(outcome, record.source, time.monotonic()):
                return JobEvent(TERMINAL, job_id, outcome=outcome.value, record=record,
                                findings=tuple(watch.findings))

    def _run_watchers_here(self, watch: LogWatch, job_id: str, run_dir: str,
                           running: bool) -> None:
        before = len(watch.findings)
        steps = watch.tick(Tick(time.time(), running))
        for finding in watch.findings[before:]:
            self.log.warning("%s %s", WATCH_LOG_MARK, json.dumps(finding.to_json()))
        for step in steps:
            try:
                if step is StopStep.SIGNAL:
                    self.hook.check(commands.scancel_signal(job_id, "TERM", run_dir))
                else:
                    self.hook.cancel(job_id)
            except (ClusterUnreachable, SlurmCommandError) as exc:
                self.log.warning("could not %s Slurm job %s: %s", step.value, job_id, exc)
                continue
            watch.done(step, time.time())
            self.log.warning("Slurm job %s: %s (log watch: %s)", job_id, step.value,
                             watch.stopping.reason)

    # -- completion ------------------------------------------------------------
    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        return self._complete(context, JobEvent.from_json(event))

    def _complete(self, context: Context, event: JobEvent) -> Any:
        job_id = event.job_id
        self._job_id = job_id
        where = self.job_location(context) or JobLocation(job_id, None, None)
        self._run_dir = where.run_dir
        if event.status not in (TERMINAL, WATCHED):
            raise ClusterUnreachable(event.message or "polling failed")
        record = event.record
        failure = None
        watched = failure_reason(event.findings)
        if watched is not None:
            # A log watcher stopped the job or ended the wait: its reason is the error, whatever
            # the job's end (one that saved on SIGTERM may end COMPLETED). Retryable.
            failure = SlurmJobFailed(
                f"{watched} [Slurm job {job_id}: {record.state} {record.state_detail}".rstrip()
                + f", exit code {record.exit_code}, log {where.log_path}]")
        elif event.outcome not in self.success_outcomes:
            if self._cancelled_by_earlier_kill(record, where):
                self.log.info("Slurm job %s was cancelled because an earlier try of this task "
                              "was killed (cleared): this try submits its own job", job_id)
                return self.execute(context)
            tail = event.log_tail
            if tail is None:
                tail = self.hook.log_tail(where.log_path) if where.log_path else ""
            failure = SlurmJobFailed(
                f"Slurm job {job_id} ended {record.state} {record.state_detail}".rstrip()
                + f" (exit code {record.exit_code}, signal {record.signal}, "
                f"classified {event.outcome}); last lines of {where.log_path}:\n{tail}")
        summary = JobSummary(job_id, event.outcome, record, where.run_dir, where.log_path,
                             self._result(event, where, quiet=failure is not None),
                             findings=event.findings)
        self.on_job_end(context, summary, failure)
        if failure is not None:
            raise failure
        self.log.info("Slurm job %s ended %s after %ss; result: %s", job_id, record.state,
                      record.elapsed_s, json.dumps(summary.result, sort_keys=True))
        return summary.to_json()

    def _result(self, event: JobEvent, where: JobLocation, *, quiet: bool) -> Any:
        """The job's result JSON: the trigger's copy (no SSH connection from this worker),
        else read from the run dir. ``quiet`` (the job failed): a read error gives None, so
        that the job's own failure is the one reported."""
        if event.result_read:
            return event.result
        if not (self.result_file and where.run_dir):
            return None
        try:
            return self.hook.read_json(posixpath.join(where.run_dir, self.result_file))
        except (ClusterUnreachable, SlurmCommandError) as exc:
            if not quiet:
                raise
            self.log.warning("result of failed job %s not read: %s", event.job_id, exc)
            return None

    def _cancelled_by_earlier_kill(self, record: JobRecord, where: JobLocation) -> bool:
        """Whether the job was cancelled by the kill of an earlier try, not by this one.

        Clearing a deferred task starts its next try at once; that try can re-attach to the
        still-running job before the old trigger's cancel lands (commands.KILLED_JOBS).
        """
        if self._killed or record.state != "CANCELLED" or not where.run_dir:
            return False
        return record.job_id in self.hook.killed_jobs(where.run_dir)

    def on_kill(self) -> None:
        """The task was killed while waiting in a worker: cancel its job."""
        self._killed = True
        if self._job_id:
            self.log.info("task killed: cancelling Slurm job %s", self._job_id)
            self.hook.cancel(self._job_id, killed_in=self._run_dir)


def _templated(*values: Any) -> bool:
    """Whether Airflow will render any of ``values`` when the task runs: Jinja, or a callable
    it calls with the context (:func:`as_data` ones: never)."""
    for value in values:
        if callable(value) or (isinstance(value, str) and ("{{" in value or "{%" in value)):
            return True
        if isinstance(value, Mapping) and _templated(*value.values()):
            return True
        if isinstance(value, list | tuple | set) and _templated(*value):
            return True
    return False
