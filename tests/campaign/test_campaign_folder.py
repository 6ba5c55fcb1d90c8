"""One bad campaign file hides nothing else (issue 14, point 2): each YAML builds or fails on
its own, editor leftovers are not campaigns, and under a real ``airflow dag-processor`` the valid
campaigns' DAGs stay while each broken one is its own import error naming file, field and
line (its own DAG file ``campaigns/x.py``, see operators/campaign/dag/folder.py)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from operators.campaign.dag.folder import (
    CampaignFolderError,
    build_campaigns,
    campaign_files,
    dag_file,
    raise_errors,
)
from operators.campaign.schema.load import CampaignConfigError
from tests.campaign.util import CAMPAIGNS, DEMO, dump, edited, raw

REPO = Path(__file__).resolve().parents[2]
STUB = CAMPAIGNS / "demo.py"  # every campaign's own DAG file is a copy of this one
# name -> (a change that breaks it, the field its error names, a fragment of its line)
BROKEN = {
    "broken_lr": ({"training.lr": -1}, "training.lr", "lr: -1"),
    "broken_key": ({"cluster.partitio": "debug"}, "cluster.partitio", "partitio:"),
}


def _line(text: str, fragment: str) -> int:
    return next(i for i, s in enumerate(text.splitlines(), 1) if fragment in s)


def _campaign(campaigns: Path, name: str, changes: dict, own_dag_file: bool = True) -> str:
    text = dump(edited(raw(DEMO), {"name": name, **changes}))
    (campaigns / f"{name}.yaml").write_text(text)
    if own_dag_file:
        shutil.copy(STUB, campaigns / f"{name}.py")
    return text


def _folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A DAG folder as shipped (the folder DAG files and demo with its own DAG file), two
    broken campaigns with theirs, and what editors leave; with the broken files' texts."""
    folder = tmp_path / "dags"
    campaigns = folder / "campaigns"
    campaigns.mkdir(parents=True)
    for name in ("pretrain_campaigns.py", "pretrain_campaign_errors.py"):
        shutil.copy(REPO / "dags" / name, folder)
    shutil.copy(DEMO, campaigns / "demo.yaml")
    shutil.copy(STUB, campaigns / "demo.py")
    texts = {name: _campaign(campaigns, name, changes) for name, (changes, _, _) in BROKEN.items()}
    os.symlink("root@host.12345:1700000000", campaigns / ".#demo.yaml")  # emacs lock: dangling
    os.symlink("root@host.12345:1700000000", campaigns / ".#demo.py")
    shutil.copy(DEMO, campaigns / "demo.yaml~")
    shutil.copy(STUB, campaigns / "demo.py~")
    (campaigns / ".demo.yaml.swp").write_bytes(b"b0VIM 9.0\x00\x00garbage")
    (campaigns / "#demo.yaml#").write_text("name: [unfinished\n")
    os.symlink("/nonexistent/x.yaml", campaigns / "gone.yaml")
    return folder, texts


def test_editor_leftovers_are_not_campaigns(tmp_path) -> None:
    campaigns = _folder(tmp_path)[0] / "campaigns"
    assert [p.name for p in campaign_files(campaigns)] == ["broken_key.yaml", "broken_lr.yaml",
                                                           "demo.yaml"]


def test_each_campaign_dag_file_builds_or_fails_on_its_own(tmp_path) -> None:
    folder, texts = _folder(tmp_path)
    namespace: dict = {}
    dag = dag_file(str(folder / "campaigns" / "demo.py"), namespace)
    assert dag.dag_id == "pretrain__demo" and namespace == {"pretrain__demo": dag}
    for name, (_, field, fragment) in BROKEN.items():
        with pytest.raises(CampaignConfigError) as caught:
            dag_file(str(folder / "campaigns" / f"{name}.py"), {})
        (problem,) = caught.value.problems
        assert (problem.field, problem.line) == (field, _line(texts[name], fragment))
        assert str(caught.value).startswith(f"campaigns/{name}.yaml:{problem.line}: {field}: ")


def test_the_folder_files_leave_campaigns_with_their_own_dag_file_alone(tmp_path) -> None:
    folder, _ = _folder(tmp_path)
    assert build_campaigns(folder / "campaigns", register=False) == []
    raise_errors(folder / "campaigns")  # the broken ones are their own files' errors


def test_a_dag_bag_of_the_folder(tmp_path) -> None:
    """Airflow's own DagBag (what the dag-processor runs per file): one import error per
    broken campaign, each naming only its own YAML, and the valid DAG beside them."""
    from airflow.dag_processing.dagbag import DagBag

    folder, texts = _folder(tmp_path)
    bag = DagBag(str(folder), bundle_path=folder)
    # demo.yaml evaluates its checkpoints (health.evaluate_checkpoints): its evaluation DAG
    # comes from the same file.
    assert sorted(bag.dag_ids) == ["pretrain__demo", "pretrain__demo__eval"]
    assert set(bag.import_errors) == {f"campaigns/{name}.py" for name in BROKEN}
    for name, (_, field, fragment) in BROKEN.items():
        message = bag.import_errors[f"campaigns/{name}.py"]
        assert f"campaigns/{name}.yaml:{_line(texts[name], fragment)}: {field}: " in message
        assert all(f"{other}.yaml" not in message for other in BROKEN if other != name)


def test_a_campaign_with_its_own_dag_file_is_named_after_it(tmp_path) -> None:
    campaigns = tmp_path / "campaigns"
    campaigns.mkdir()
    shutil.copy(DEMO, campaigns / "renamed.yaml")
    shutil.copy(STUB, campaigns / "renamed.py")
    with pytest.raises(CampaignConfigError) as caught:
        dag_file(str(campaigns / "renamed.py"), {})
    (problem,) = caught.value.problems
    assert (problem.field, problem.line) == ("name", _line(DEMO.read_text(), "name: demo"))
    assert "'demo'" in problem.message and "'renamed'" in problem.message


def test_check_runs_the_code_of_the_campaign_s_own_dag_file(tmp_path) -> None:
    import io

    from operators.campaign.dag.check import check_file

    shutil.copy(DEMO, tmp_path / "renamed.yaml")
    out = io.StringIO()
    assert check_file(tmp_path / "renamed.yaml", out)  # no DAG file of its own: any name
    shutil.copy(STUB, tmp_path / "renamed.py")
    out = io.StringIO()
    assert not check_file(tmp_path / "renamed.yaml", out)
    line = _line(DEMO.read_text(), "name: demo")
    assert out.getvalue().startswith(f"{tmp_path / 'renamed.yaml'}:{line}: name: is 'demo'")


def test_a_dag_file_without_its_campaign(tmp_path) -> None:
    shutil.copy(STUB, tmp_path / "orphan.py")
    with pytest.raises(CampaignConfigError, match="orphan.yaml: no campaign file beside"):
        dag_file(str(tmp_path / "orphan.py"), {})


def test_a_campaign_without_its_own_dag_file(tmp_path) -> None:
    """Dropped in alone, a YAML is built by the folder DAG file; broken, it is a line of the
    folder's shared import error (pretrain_campaign_errors.py)."""
    campaigns = tmp_path / "campaigns"
    campaigns.mkdir()
    shutil.copy(DEMO, campaigns / "demo.yaml")
    shutil.copy(STUB, campaigns / "demo.py")
    _campaign(campaigns, "alone", {}, own_dag_file=False)
    broken = _campaign(campaigns, "alone_broken", {"training.lr": -1}, own_dag_file=False)
    outcomes = {o.path.name: o for o in build_campaigns(campaigns, register=False)}
    assert set(outcomes) == {"alone.yaml", "alone_broken.yaml"}  # demo has its own file
    assert outcomes["alone.yaml"].dag.dag_id == "pretrain__alone"
    with pytest.raises(CampaignFolderError) as caught:
        raise_errors(campaigns)
    assert f"campaigns/alone_broken.yaml:{_line(broken, 'lr: -1')}: training.lr: " in str(
        caught.value)


def test_two_files_with_one_name(tmp_path) -> None:
    campaigns = tmp_path / "campaigns"
    campaigns.mkdir()
    shutil.copy(DEMO, campaigns / "a.yaml")
    shutil.copy(DEMO, campaigns / "b.yaml")
    shutil.copy(DEMO, campaigns / "demo.yaml")
    shutil.copy(STUB, campaigns / "demo.py")  # demo.yaml owns pretrain__demo
    with pytest.raises(CampaignFolderError) as caught:
        raise_errors(campaigns)
    assert "campaigns/a.yaml: name: pretrain__demo is already defined by demo.yaml" in str(
        caught.value)
    assert "campaigns/b.yaml: name: pretrain__demo is already defined by demo.yaml" in str(
        caught.value)


def test_the_shipped_folder() -> None:
    """Every shipped campaign has its own DAG file, a copy of one stub, and builds."""
    raise_errors(CAMPAIGNS)
    for path in campaign_files(CAMPAIGNS):
        assert path.with_suffix(".py").read_bytes() == STUB.read_bytes(), path.name
        dag_file(str(path.with_suffix(".py")), {})


# -- under a real dag-processor ------------------------------------------------------------------
def _wait(what: str, check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(2)
    raise TimeoutError(f"waited {timeout}s for {what}")


def _cli_json(env: dict[str, str], *args: str) -> list[dict]:
    import json
    import subprocess

    from tests.support.airflow import AIRFLOW

    # `airflow dags list-import-errors` exits 1 when there are import errors; its JSON (Airflow
    # 3.3.2, recorded here) is [{"bundle_name": ..., "filepath": "campaigns/x.py",
    # "error": "<traceback>"}], printed on the last line after the CLI's warnings.
    out = subprocess.run([AIRFLOW, *args, "-o", "json"], env=env, cwd=REPO,
                         capture_output=True, text=True).stdout
    for line in reversed(out.splitlines()):  # its JSON is the last line; warnings come first
        if line.startswith("["):
            return json.loads(line)
    raise AssertionError(f"no JSON list in the output of airflow {' '.join(args)}: {out}")


@pytest.mark.airflow
def test_broken_campaigns_under_airflow_dag_processor(tmp_path) -> None:
    """``airflow dag-processor`` alone (no ports, no scheduler) on the folder, read back with
    ``airflow dags list-import-errors`` / ``airflow dags list``, as an operator would."""
    import signal
    import subprocess

    from tests.support.airflow import AIRFLOW, airflow_env, migrate

    folder, texts = _folder(tmp_path)
    home = tmp_path / "airflow-home"
    home.mkdir()
    env = airflow_env(home, folder)
    migrate(env)
    own = {name: f"campaigns/{name}.py" for name in BROKEN}
    with open(home / "dag-processor.log", "ab") as log:
        proc = subprocess.Popen([AIRFLOW, "dag-processor"], env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def state() -> tuple[dict[str, str], set[str]]:
            errors = {e["filepath"]: e["error"]
                      for e in _cli_json(env, "dags", "list-import-errors")}
            return errors, {d["dag_id"] for d in _cli_json(env, "dags", "list")}

        def until(check):
            def poll():
                found = state()
                return found if check(*found) else None
            return poll

        errors, dags = _wait("an import error per broken campaign and demo's DAG", until(
            lambda errors, dags: errors.keys() >= set(own.values()) and "pretrain__demo" in dags),
            600)
        assert set(errors) == set(own.values())  # leftovers and the folder files: none
        assert dags == {"pretrain__demo", "pretrain__demo__eval"}  # with its evaluation DAG
        for name, (_, field, fragment) in BROKEN.items():
            assert f"campaigns/{name}.yaml:{_line(texts[name], fragment)}: {field}: " \
                   in errors[own[name]]
            assert all(f"{o}.yaml" not in errors[own[name]] for o in BROKEN if o != name)

        # One fixed: its error goes and its DAG comes; the other error and demo stay.
        (folder / "campaigns" / "broken_lr.yaml").write_text(
            dump(edited(raw(DEMO), {"name": "broken_lr"})))
        errors, dags = _wait("the fixed campaign's error to clear and its DAG", until(
            lambda errors, dags: own["broken_lr"] not in errors
            and "pretrain__broken_lr" in dags), 600)
        assert set(errors) == {own["broken_key"]}
        assert dags == {"pretrain__demo", "pretrain__demo__eval", "pretrain__broken_lr",
                        "pretrain__broken_lr__eval"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
