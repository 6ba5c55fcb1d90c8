"""Code shipping (operators/campaign/adapters/code_ship.py) over the real SSH/SFTP connection to the
local cluster: one content-addressed copy of ``jobscripts`` per version under the campaign's
directory, uploaded once, and the cluster's Python importing it from there."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from operators.campaign.adapters.code_ship import MARKER, code_version, package_root, ship
from operators.campaign.render.layout import Layout
from operators.slurm.hook import SlurmHook
from tests.support import cluster

pytestmark = pytest.mark.cluster
ROOT = Path("/home/pretrain/pp-test-code-ship")


@pytest.fixture
def hook(local_cluster, monkeypatch) -> SlurmHook:
    for name, value in cluster.connection_env().items():
        monkeypatch.setenv(name, value)
    yield SlurmHook(cluster.CONN_ID)
    shutil.rmtree(ROOT, ignore_errors=True)


def test_digest_follows_the_files(tmp_path):
    copy = tmp_path / "jobscripts"
    shutil.copytree(package_root(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    same = code_version(copy)
    assert same.digest == code_version().digest and "jobscripts/common.py" in same.files
    (copy / "common.py").write_text((copy / "common.py").read_text() + "\n# changed\n")
    assert code_version(copy).digest != same.digest


def test_shipped_once_per_version_and_imported_from_there(hook, tmp_path):
    paths = Layout(campaign_dir=str(ROOT / uuid.uuid4().hex), checkpoint_dir="/unused")
    version = code_version()
    code_dir = ship(hook, paths, version)
    assert code_dir == f"{paths.campaign_dir}/code/{version.digest}"
    shipped = Path(code_dir)
    for name, data in version.files.items():
        assert (shipped / name).read_bytes() == data, name
    assert (shipped / MARKER).is_file()
    # A second task of the same version uploads nothing: a file removed behind its back
    # stays removed (the marker says the version is there).
    (shipped / "jobscripts" / "results.py").unlink()
    assert ship(hook, paths, version) == code_dir
    assert not (shipped / "jobscripts" / "results.py").exists()
    # Another version goes beside it; the first one is left as it was.
    copy = tmp_path / "jobscripts"
    shutil.copytree(package_root(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "marker_module.py").write_text("WHERE = __file__\n")
    other = ship(hook, paths, code_version(copy))
    assert other != code_dir and Path(other, "jobscripts", "marker_module.py").is_file()
    # The cluster's Python (as the cluster user, over SSH) imports the shipped package.
    python = cluster.connection()["extra"]["remote_python"]
    rc, out, err = hook.run(f"cd / && PYTHONPATH={other} {python} -c "
                            "'import jobscripts.marker_module as m; print(m.WHERE)'")
    assert rc == 0 and out.strip() == f"{other}/jobscripts/marker_module.py", err
    owner = subprocess.run(["stat", "-c", "%U", other], capture_output=True, text=True).stdout
    assert owner.strip() == "pretrain"
