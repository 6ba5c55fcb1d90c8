"""``docker/local_cluster.sh up`` on a changed tree while a job runs from the job venv: the job
goes on importing the version it started with (nothing pulled from under it), a process started
after the switch gets the new one, and an unchanged tree changes nothing (issue 16, part 1).

Disruptive: it re-installs the project into the cluster's job venv (from a copy of this tree
with one module changed) and puts this tree's version back in ``finally``.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest

from operators.slurm.jobkey import job_key
from operators.slurm.spec import JobSpec
from operators.slurm.states import classify
from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.disruptive]

REPO = Path(__file__).resolve().parents[2]
MARK = "REINSTALL_TEST_MARK"
# Imports one project module at start, waits for the flag, then imports another: in-place
# reinstalls handed it the new file (or none) at that point.
LATE_IMPORT = """
import json, pathlib, sys, time
import jobscripts.results as early
flag = pathlib.Path(sys.argv[1])
print("started", flush=True)
while not flag.exists():
    time.sleep(0.2)
import jobscripts.vocabulary as late
print(json.dumps({"early": early.__file__, "late": late.__file__,
                  "mark": getattr(late, "MARK_NAME", None)}), flush=True)
""".replace("MARK_NAME", MARK)
NEW_PROCESS = f"import jobscripts.vocabulary as v; print(getattr(v, {MARK!r}, None))"


def changed_copy(root: Path) -> Path:
    """This tree's tracked files (as they are now) with one line added to a module."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.split(b"\0")
    subprocess.run(["tar", "-C", str(REPO), "--null", "--files-from=-", "-cf", "copy.tar"],
                   input=b"\0".join(f for f in files if f and (REPO / f.decode()).exists()),
                   cwd=root, check=True)
    subprocess.run(["tar", "-xf", "copy.tar"], cwd=root, check=True)
    module = root / "jobscripts" / "vocabulary.py"
    module.write_text(module.read_text() + f'\n{MARK} = "new"\n')
    return root


def current_version() -> str:
    python = cluster.connection()["extra"]["remote_python"]
    return cluster.remote(f"{shlex.quote(python)} -c "
                          + shlex.quote("import jobscripts, os; print(os.path.dirname("
                                        "os.path.dirname(jobscripts.__file__)))")).strip()


def test_reinstall_leaves_running_jobs_their_files(hook, tmp_path) -> None:
    python = cluster.connection()["extra"]["remote_python"]
    copy = changed_copy(tmp_path)
    before = current_version()
    key = job_key("reinstall", uuid.uuid4().hex, "t")
    run_dir = hook.run_dir(key)
    flag = posixpath.join(run_dir, "go")
    hook.upload(run_dir, {"late_import.py": LATE_IMPORT})
    spec = JobSpec(name=key, comment=key, workdir=run_dir, time="5",
                   command=f"{shlex.quote(python)} late_import.py {shlex.quote(flag)}",
                   output=posixpath.join(run_dir, "slurm-%j.out")).validate()
    job_id = hook.submit(spec, run_dir)
    log = posixpath.join(run_dir, f"slurm-{job_id}.out")
    try:
        cluster.wait_for(lambda: b"started" in hook.read_bytes(log), 120, "the job to start")
        subprocess.run(["bash", str(copy / "docker" / "local_cluster.sh"), "up"], check=True,
                       capture_output=True)
        after = current_version()
        assert after != before  # the changed tree was installed, in a directory of its own
        assert cluster.remote(f"{shlex.quote(python)} -c {shlex.quote(NEW_PROCESS)}").strip() == (
            "new")
        hook.upload(run_dir, {"go": ""})
        record = cluster.wait_for(
            lambda: (r := hook.describe(job_id, name=key)) and r.source == "sacct"
            and classify(r.state).terminal and r, 120, "the job to end")
        assert record.state == "COMPLETED", hook.read_bytes(log)
        seen = json.loads(hook.read_bytes(log).decode().splitlines()[-1])
        # The late import came from the version the job started on, whole and unchanged.
        assert seen["mark"] is None
        assert seen["early"].startswith(before) and seen["late"].startswith(before)
    finally:
        cluster.restart_cluster_services()  # this tree's version back
    assert current_version() == before
    # Unchanged tree: `up` again changes nothing (the .pth and the version stay).
    cluster.restart_cluster_services()
    assert current_version() == before
