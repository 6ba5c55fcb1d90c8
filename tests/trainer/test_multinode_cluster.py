"""2-node segments of the reference trainer on the real 3-node local cluster, through the
worker's SlurmHook (no Airflow): the job is the one reference.py renders (one srun task per
node starting torchrun), with a tiny synthetic run config.

One story: a 1-node run of 6 iterations and, beside it, a 2-node run of iterations 1-3 on
node[1-2]; then the 2-node run resumes on node[2-3] (node1 excluded) for 4-6. The losses must
be the 1-node run's within float tolerance, the log must hold each iteration once (only rank 0
logs), and every checkpoint must have been written once, by rank 0.

Needs the cluster: ``flock -s /tmp/pp-cluster.lock`` (it takes all three nodes for a while).
"""

from __future__ import annotations

import json
import math
import posixpath
import time
import uuid
from pathlib import Path

import pytest

from jobscripts import checkpoints
from jobscripts.job_files import COMPLETE_MARKER, SEGMENT_RESULT
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.render.reference import CONFIG_FILE, reference_segment
from operators.campaign.schema.load import campaign_from_dict
from operators.slurm.jobkey import job_key
from operators.slurm.operator import LOG_NAME, PYTHON_ENV, build_spec
from tests.campaign.util import edited, raw
from tests.support import cluster
from tests.support.trainer import losses
from tests.trainer.synthetic_data import base_config, write_dataset
from tests.trainer.test_multinode_launch import CI_CAMPAIGN

pytestmark = pytest.mark.cluster

PREFIX = "synthetic_text_document"


def campaign(nodes: int):
    return campaign_from_dict(edited(raw(CI_CAMPAIGN), {"cluster.nodes": nodes,
                                                        "cluster.time_limit": "10"}))


def segment_spec(hook, nodes: int, name: str, **job_changes):
    """(key, run dir, spec) of one segment job as reference.py renders it."""
    c = campaign(nodes)
    request = reference_segment(c, Layout.for_campaign(c), RunInputs.of(["/unused"]))
    key = job_key("multinode", uuid.uuid4().hex[:8], name)
    run_dir = hook.run_dir(key)
    env = {PYTHON_ENV: hook.settings.remote_python, **request.environment}
    return key, run_dir, build_spec(key, run_dir, request.command,
                                    {**request.job, **job_changes}, env)


def submit(hook, nodes: int, config: dict, name: str, **job_changes) -> tuple[str, str, str]:
    """(key, run dir, job id) of one segment job as reference.py renders it."""
    key, run_dir, spec = segment_spec(hook, nodes, name, **job_changes)
    return key, run_dir, hook.submit(spec, run_dir, {CONFIG_FILE: json.dumps(config)})


def wait_done(hook, job_id: str, key: str, timeout: float = 900):
    return cluster.wait_job_end(hook, job_id, key, timeout)


def upload_dataset(hook, tmp_path) -> str:
    """The synthetic dataset in a directory of its own on the cluster's shared filesystem."""
    local = write_dataset(tmp_path / PREFIX)
    data_dir = hook.run_dir(job_key("multinode", uuid.uuid4().hex[:8], "data"))
    hook.upload(data_dir, {PREFIX + s: (local.parent / (PREFIX + s)).read_bytes()
                           for s in (".bin", ".idx")})
    return posixpath.join(data_dir, PREFIX)


def tiny_config(prefix: str, save: str, **changes) -> dict:
    config = base_config(Path(prefix), Path(save),
                         **{"train_iters": 6, "save_interval": 3, "eval_interval": 3, **changes})
    # The job writes it into its own run directory; data_cache beside the checkpoints.
    config["segment_result"] = SEGMENT_RESULT
    config["data_path"] = [prefix]
    config["save"] = save
    return config


def test_two_nodes_train_as_one_and_resume_on_another_pair(hook, tmp_path):
    prefix = upload_dataset(hook, tmp_path)
    root = posixpath.dirname(prefix)
    one = tiny_config(prefix, posixpath.join(root, "ckpt-1node"))
    two = tiny_config(prefix, posixpath.join(root, "ckpt-2node"), exit_interval=3)
    started = time.monotonic()
    single = submit(hook, 1, one, "one", exclude="node1,node2")
    first = submit(hook, 2, two, "two-a", exclude="node3")
    records = {name: wait_done(hook, job[2], job[0])
               for name, job in (("one", single), ("two-a", first))}
    second = submit(hook, 2, two, "two-b", exclude="node1")
    records["two-b"] = wait_done(hook, second[2], second[0])
    elapsed = time.monotonic() - started
    logs = {name: hook.read_bytes(posixpath.join(job[1], LOG_NAME.replace("%j", job[2])))
            .decode() for name, job in (("one", single), ("two-a", first), ("two-b", second))}
    for name, record in records.items():
        assert record.state == "COMPLETED", (name, record, logs[name][-3000:])
    assert (records["two-a"].nodelist, records["two-b"].nodelist) == ("node[1-2]", "node[2-3]")

    reference = losses(logs["one"])
    split = losses(logs["two-a"] + logs["two-b"])  # fails on an iteration logged twice
    assert sorted(split) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    for iteration, loss in split.items():
        assert math.isclose(loss, reference[iteration], rel_tol=1e-5), (iteration, split, reference)

    segments = [hook.read_json(posixpath.join(job[1], SEGMENT_RESULT)) for job in (first, second)]
    assert [s["world_size"] for s in segments] == [2, 2]
    assert [(s["start_iteration"], s["end_iteration"]) for s in segments] == [(0, 3), (3, 6)]
    assert segments[1]["resumed_from"]["iteration"] == 3
    assert segments[1]["iterations_redone"] == 0
    # Saved once per iteration, by rank 0 of the job that trained it.
    for iteration, job in ((3, first), (6, second)):
        marker = hook.read_json(posixpath.join(two["save"], checkpoints.ITER_DIR_FORMAT.format(
            iteration), COMPLETE_MARKER))
        assert marker["metadata"]["job_id"] == job[2]
    assert logs["two-a"].count("successfully saved checkpoint from iteration       3") == 1
    print(f"1-node 6 iterations beside 2-node 3+3 on two pairs: {elapsed:.0f} s")
