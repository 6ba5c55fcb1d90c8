"""One bad campaign file hides nothing else (issue 14, point 2): each YAML builds or fails on
its own, editor leftovers are not campaigns, and under a real dag-processor the valid
campaigns' DAGs stay while the broken one is an import error naming file, field and line."""

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
    raise_errors,
)
from tests.campaign.util import CAMPAIGNS, DEMO, dump, edited, raw

REPO = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path) -> Path:
    """A DAG folder as shipped, plus a broken campaign and what editors leave."""
    folder = tmp_path / "dags"
    campaigns = folder / "campaigns"
    campaigns.mkdir(parents=True)
    for dag_file in ("pretrain_campaigns.py", "pretrain_campaign_errors.py"):
        shutil.copy(REPO / "dags" / dag_file, folder)
    shutil.copy(DEMO, campaigns / "demo.yaml")
    (campaigns / "broken.yaml").write_text(DEMO.read_text().replace("name: demo", "name: broken")
                                           .replace("lr: 1.0e-3", "lr: -1"))
    os.symlink("root@host.12345:1700000000", campaigns / ".#demo.yaml")  # emacs lock: dangling
    shutil.copy(DEMO, campaigns / "demo.yaml~")
    (campaigns / ".demo.yaml.swp").write_bytes(b"b0VIM 9.0\x00\x00garbage")
    (campaigns / "#demo.yaml#").write_text("name: [unfinished\n")
    os.symlink("/nonexistent/x.yaml", campaigns / "gone.yaml")
    return folder


def _broken_line() -> int:
    return next(i for i, s in enumerate(DEMO.read_text().splitlines(), 1)
                if s.strip().startswith("lr: "))


def test_editor_leftovers_are_not_campaigns(tmp_path) -> None:
    campaigns = _folder(tmp_path) / "campaigns"
    assert [p.name for p in campaign_files(campaigns)] == ["broken.yaml", "demo.yaml"]


def test_each_file_builds_or_fails_on_its_own(tmp_path) -> None:
    outcomes = {o.path.name: o for o in build_campaigns(_folder(tmp_path) / "campaigns",
                                                        register=False)}
    assert outcomes["demo.yaml"].dag.dag_id == "pretrain__demo"
    broken = outcomes["broken.yaml"]
    assert broken.dag is None
    (problem,) = broken.error.problems
    assert (problem.field, problem.line) == ("training.lr", _broken_line())
    assert str(broken.error) == f"campaigns/broken.yaml:{_broken_line()}: training.lr: " \
                                + problem.message


def test_two_files_with_one_name(tmp_path) -> None:
    campaigns = tmp_path / "campaigns"
    campaigns.mkdir()
    shutil.copy(DEMO, campaigns / "a.yaml")
    shutil.copy(DEMO, campaigns / "b.yaml")
    with pytest.raises(CampaignFolderError) as caught:
        raise_errors(campaigns)
    assert "campaigns/b.yaml: name: pretrain__demo is already defined by a.yaml" in str(
        caught.value)


def test_the_shipped_folder_has_no_errors() -> None:
    raise_errors(CAMPAIGNS)


# -- under a real dag-processor ------------------------------------------------------------------
def _import_errors(server) -> dict[str, str]:
    body = server.request("GET", "/api/v2/importErrors")
    return {e["filename"]: e["stack_trace"] for e in body["import_errors"]}


def _wait(what: str, check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(2)
    raise TimeoutError(f"waited {timeout}s for {what}")


@pytest.mark.airflow
def test_a_broken_campaign_under_a_real_dag_processor(tmp_path) -> None:
    from tests.support.airflow import Standalone, airflow_env

    folder = _folder(tmp_path)
    home = tmp_path / "airflow-home"
    home.mkdir()
    server = Standalone(airflow_env(home, folder), home / "standalone.log").start()
    try:
        errors = _wait("the campaign import error",
                       lambda: _import_errors(server).get("pretrain_campaign_errors.py"))
        assert f"campaigns/broken.yaml:{_broken_line()}: training.lr: " in errors
        assert set(_import_errors(server)) == {"pretrain_campaign_errors.py"}  # leftovers: none
        server.wait_dag("pretrain__demo")
        demo = server.request("GET", "/api/v2/dags/pretrain__demo")
        assert not demo["is_stale"] and not demo["has_import_errors"]

        # Fixed, the error goes and the campaign's DAG comes, the other one untouched.
        fixed = edited(raw(DEMO), {"name": "fixed"})
        (folder / "campaigns" / "broken.yaml").write_text(dump(fixed))
        _wait("the error to clear", lambda: "pretrain_campaign_errors.py"
              not in _import_errors(server))
        server.wait_dag("pretrain__fixed")
        assert not server.request("GET", "/api/v2/dags/pretrain__demo")["is_stale"]
    finally:
        server.stop()
