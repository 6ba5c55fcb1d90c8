"""Property-based: mutated copies of every shipped campaign (keys, types, numbers, strings
with shell metacharacters, templates, newlines, unicode, broken bytes) are either refused
with the project's error, each problem naming its field or line, or accepted, and then
build their DAG and render job scripts that ``bash -n`` accepts and that, executed under
stub commands in a scratch directory, hand every value over intact and run nothing else.
No other exception type escapes. Pure: no cluster, no Airflow services (issue 14, point 6).
"""

from __future__ import annotations

import copy
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from operators.campaign.dag.dag_factory import build_dag
from operators.campaign.dag.folder import campaign_files
from operators.campaign.dag.preflight import PreflightOperator, preflight_request
from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.schema.load import CampaignConfigError, load_campaign
from operators.slurm.operator import PYTHON_ENV, SlurmJobOperator, build_spec
from operators.slurm.render import render_script
from tests.campaign.util import CAMPAIGNS, raw

BASES = {p.name: raw(p) for p in campaign_files(CAMPAIGNS)}
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
MARKER = "PWNED"  # a file that only an injected command would create
HOSTILE = [
    f"$(touch {MARKER})", f"`touch {MARKER}`", f"; touch {MARKER}", f"| touch {MARKER}",
    f"&& touch {MARKER}", f"> {MARKER}", f"'; touch {MARKER}; '", f'"; touch {MARKER}; "',
    f"\\'; touch {MARKER} #", "{{ 7*7 }}", "{% if 1 %}x{% endif %}",
    "{{ conn.slurm_local.password }}", "{{ var.value.get('x') }}",
    "{{ '%c' % 36 }}(touch PWNED)", "line1\nline2", "a\rb", "\x00",
    "--help", "--fakeroot", "-rf", "../../etc", "/", "/a/../b", "é中文🙂", "\u202e", "*", "~",
    "#", "!", "%j", "a b", "", " ", "x" * 5000, "1e999", "nan", "inf", "yes", "null",
    "0 0 31 2 *", "\u0660 \u0663 * * *", "@hourly", "s3://b/p", "hf://datasets/a/b/x.parquet",
]
# The characters that mean something to bash, Jinja, Slurm or YAML, and some that look alike.
ALPHABET = st.sampled_from(list(" \t\n$`;|&<>(){}[]*?!#~%^'\"\\=:,@+-_./aZ09é中🙂\u202e\u0663"))
TEXT = st.one_of(st.sampled_from(HOSTILE), st.text(ALPHABET, max_size=30),
                 st.tuples(st.sampled_from(HOSTILE), st.text(ALPHABET, max_size=8)).map(
                     lambda t: t[1] + t[0] + t[1]))
SCALAR = st.one_of(TEXT, st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2**63, 10**30]),
                   st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none())
VALUE = st.one_of(SCALAR, st.lists(SCALAR, max_size=3),
                  st.dictionaries(TEXT, SCALAR, max_size=3))
# What an environment value may hold, including what bash, Jinja and YAML read specially.
ENV_TEXT = st.one_of(
    st.sampled_from(["{{ 7*7 }}", "{{ conn.slurm_local.password }}", "{% for x in y %}",
                     "{{ '%c' % 36 }}(touch PWNED)", "a b  c", "'", '"', "\"'\"'", "*", "~",
                     "#x", "!!", "%j", "-rf", "é中文🙂", "\u202e", "yes", "null", "1e999", ""]),
    st.text(st.sampled_from(list(" '\"(){}[]*?!#~%^=:,@+-_./aZ09é中🙂\u202e")), max_size=30))
ENV_KEY = st.one_of(st.sampled_from(["NCCL_DEBUG", "A", "HF_HOME", "PP_X", "UID", "IFS",
                                     "SLURM_X", "a-b", "1X", "É", "", "PATH"]),
                    st.text(ALPHABET, min_size=1, max_size=10))


def _leaves(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        out = [prefix] if prefix else []
        for key, value in node.items():
            out += _leaves(value, (*prefix, key))
        return out
    if isinstance(node, list):
        return [prefix] + [p for i, v in enumerate(node) for p in _leaves(v, (*prefix, i))]
    return [prefix]


# Optional fields the shipped files leave out, where a value lands in a script if accepted.
EXTRA_PATHS = [("cluster", "partition"), ("cluster", "account"), ("cluster", "qos"),
               ("cluster", "mem"), ("cluster", "cpus_per_task"), ("cluster", "container"),
               ("cluster", "container", "image"), ("data", "tokenizer", "path"),
               ("data", "manifest"), ("checkpoint", "dir"), ("schedule",), ("description",),
               ("tracking", "experiment"), ("segments", "iters_per_segment")]


def _set(doc: Any, path: tuple, value: Any) -> None:
    node = doc
    for part in path[:-1]:
        if isinstance(node, list):
            node = node[part] if isinstance(part, int) and part < len(node) else None
        elif isinstance(node, dict):
            if not isinstance(node.get(part), dict | list):
                node[part] = {}
            node = node[part]
        if node is None:
            return
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(path[-1], int)
                                  and path[-1] < len(node)):
        node[path[-1]] = value


def _delete(doc: Any, path: tuple) -> None:
    node = doc
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    """(what was done, the file's bytes)."""
    name = draw(st.sampled_from(sorted(BASES)))
    doc = copy.deepcopy(BASES[name])
    paths = _leaves(doc) + EXTRA_PATHS
    kinds = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["set", "set", "env", "env", "env_ok", "env_ok", "env_ok",
                                     "delete", "typo", "unknown"]))
        kinds.append(kind)
        path = draw(st.sampled_from(paths))
        if kind == "set":
            _set(doc, path, draw(VALUE))
        elif kind == "env":
            _set(doc, ("cluster", "environment", draw(ENV_KEY)), draw(SCALAR))
        elif kind == "env_ok":  # a name a job may export, a value that is only tricky
            where = draw(st.sampled_from([("cluster",), ("cluster", "container")]))
            _set(doc, (*where, "environment", draw(st.sampled_from(["NCCL_DEBUG", "X_1"]))),
                 draw(ENV_TEXT))
        elif kind == "delete":
            _delete(doc, path)
        elif kind in ("typo", "unknown"):
            parent, key = path[:-1], path[-1] if path else "name"
            _delete(doc, path) if kind == "typo" else None
            _set(doc, (*parent, f"{key}{draw(st.sampled_from(['s', '_', 'X']))}"), draw(SCALAR))
    data = yaml.dump(doc, Dumper=DUMPER, allow_unicode=draw(st.booleans()),
                     sort_keys=False).encode()
    if draw(st.integers(0, 9)) == 0:  # a damaged file
        kinds.append("bytes")
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(max_size=8)) + data[at + draw(st.integers(0, 20)):]
    return "+".join(sorted(set(kinds))), data


# -- rendering and running what an accepted campaign produces ----------------------------------
STUB_DIR = Path(tempfile.mkdtemp(prefix="pp-fuzz-stubs-"))
RECORD = 'printf "%s\\0" "$@" > "$PP_FUZZ_OUT/argv"; env -0 > "$PP_FUZZ_OUT/env"\n'
STUBS = {
    "python": RECORD,
    "python3": RECORD,  # what runs inside a container (here: on the host)
    "torchrun": RECORD,
    "scontrol": "echo node1\n",
    # srun OPTIONS... CMD...; apptainer run|exec [--nv] [--bind X]... IMAGE CMD...
    "srun": 'while [[ $1 == --* ]]; do shift; done; exec "$@"\n',
    # apptainer ... IMAGE [ENTRYPOINT] bash -c INNER: the inner shell runs, here, on the host.
    "apptainer": 'while (($#)) && [[ $1 != bash ]]; do shift; done; exec "$@"\n',
}
for _name, _body in STUBS.items():
    (STUB_DIR / _name).write_text("#!/bin/bash\n" + _body)
    (STUB_DIR / _name).chmod(0o755)
STUB_PYTHON = str(STUB_DIR / "python")


# What Slurm sets in a batch job's environment (a one-node, one-task allocation).
SLURM_ENV = {name: value for name, value in (
    ("SLURM_JOB_ID", "1"), ("SLURM_JOB_NAME", "pp-fuzz"), ("SLURM_JOB_NODELIST", "node1"),
    ("SLURM_NODELIST", "node1"), ("SLURM_NNODES", "1"), ("SLURM_JOB_NUM_NODES", "1"),
    ("SLURM_NODEID", "0"), ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0"), ("SLURM_NTASKS", "1"),
    ("SLURM_NTASKS_PER_NODE", "1"), ("SLURM_CPUS_PER_TASK", "1"), ("SLURM_CPUS_ON_NODE", "1"),
    ("SLURM_GPUS_ON_NODE", "0"), ("SLURM_RESTART_COUNT", "0"), ("SLURMD_NODENAME", "node1"))}


class _Ti:
    def xcom_pull(self, task_ids: str, **_kw) -> dict:
        return {"run_dir": "/runs/ingest"}


def _scripts(campaign) -> list[tuple[str, str, dict]]:
    """(task id, script, environment) for every job of the campaign's DAG."""
    dag = build_dag(campaign, auto_register=False)
    layout = Layout.for_campaign(campaign)
    out = []
    for task in dag.tasks:
        if isinstance(task, TrainingSegmentOperator):
            kwargs = _segment(campaign, layout)
        elif isinstance(task, PreflightOperator):  # renders its job when it runs, like a segment
            kwargs = preflight_request(campaign, layout, RunInputs.stand_in(campaign, layout),
                                       []).to_json()
        elif isinstance(task, SlurmJobOperator):
            task.render_template_fields({"ti": _Ti(), "params": {}})
            kwargs = {"command": task.command, "job": task.job, "environment": task.environment}
        else:
            continue
        env = {PYTHON_ENV: STUB_PYTHON, **kwargs["environment"]}
        spec = build_spec(f"pp-{task.task_id.replace('.', '_')}", "/runs/job", kwargs["command"],
                          kwargs["job"], env)
        out.append((task.task_id, render_script(spec), env))
    return out


def _segment(campaign, layout: Layout) -> dict:
    if campaign.model.reference is not None:
        from operators.campaign.render.reference import reference_segment

        return reference_segment(campaign, layout,
                                 RunInputs.of(["/data/corpus_text_document"])).to_json()
    from operators.campaign.render.bridge import bridge_segment

    inputs = RunInputs.of(["/data/corpus_text_document"], tokenizer_dir=layout.tokenizer)
    return bridge_segment(campaign, layout, inputs).to_json()


def _run(script: str, work: Path) -> dict[str, str] | None:
    """The environment the job's program saw (None: the job runs no program of ours)."""
    (work / "job.sbatch").write_text(script)
    env = {"PATH": f"{STUB_DIR}:/usr/bin:/bin", "HOME": str(work), "PP_FUZZ_OUT": str(work),
           **SLURM_ENV, "SLURM_SUBMIT_DIR": str(work),
           # A cluster's own commands (module, ml, ...) are not here: bash calls this instead.
           "BASH_FUNC_command_not_found_handle%%":
               '() { printf "%s\\n" "$*" >> "$PP_FUZZ_OUT/unknown_commands"; }'}
    proc = subprocess.run(["bash", "job.sbatch"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, (proc.stderr, script)
    assert not any(p.name == MARKER for p in work.rglob("*")), script
    unknown = work / "unknown_commands"
    assert not unknown.exists() or MARKER not in unknown.read_text(), script
    if not (work / "env").exists():
        return None
    recorded = (work / "env").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in recorded if b"=" in item)


def _check_accepted(campaign) -> None:
    scripts = _scripts(campaign)
    for task_id, script, _env in scripts:
        syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert syntax.returncode == 0, (task_id, syntax.stderr, script)
    inside = dict(campaign.cluster.container.environment) if campaign.cluster.container else {}
    for task_id, script, env in scripts:
        with tempfile.TemporaryDirectory(prefix="pp-fuzz-run-") as work:
            seen = _run(script, Path(work))
        for key, value in env.items():
            assert f"export {key}={shlex.quote(value)}\n" in script
        # The program sees each value as written: the host's, or in a container job the
        # container's (its inner shell exports them after the host's).
        for key in {*env, *inside}:
            allowed = {env.get(key), *([inside[key]] if key in inside else [])}  # None: a
            # name only the container has, which a host job never sees
            assert seen is None or seen.get(key) in allowed, (task_id, key, seen.get(key))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated())
def test_mutated_campaigns_are_refused_clearly_or_render_safe_scripts(case) -> None:
    kinds, data = case
    with tempfile.TemporaryDirectory(prefix="pp-fuzz-") as folder:
        path = Path(folder) / "campaign.yaml"
        path.write_bytes(data)
        try:
            campaign = load_campaign(path)
        except CampaignConfigError as exc:
            event(f"refused {kinds}")
            assert exc.problems
            for problem in exc.problems:
                # A damaged file may be refused as a whole (not UTF-8, NUL bytes); anything
                # else names the field, or the YAML line it cannot read.
                assert problem.field or problem.line or "bytes" in kinds, (problem, data)
                assert problem.located(str(path)) in str(exc)
            return
    event(f"accepted {kinds}")
    _check_accepted(campaign)


def test_the_unmutated_campaigns_render_and_run() -> None:
    for name in BASES:
        _check_accepted(load_campaign(CAMPAIGNS / name))
