"""``data.array_tasks``: ingest and tokenization as Slurm job arrays plus a merge job each
(issue 16 part 4), as the campaign renders them. Pure: the rendered sbatch scripts, the DAG's
tasks, the schema.

The default (1) keeps the one tokenize job of the golden files; N > 1 renders an array of N
tasks (``--array=0-<N-1>``, each ``--array-tasks N``, its group from ``SLURM_ARRAY_TASK_ID``)
and makes the ``data.tokenize`` task's own job the merge (``--merge-tasks N``), submitted by
the same task after the array (``ArrayFirst``), so the DAG's task ids do not change.
"""

from __future__ import annotations

import pytest

from operators.campaign.render import stages
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import CampaignConfigError, campaign_from_dict
from operators.slurm.operator import build_spec
from operators.slurm.render import render_script
from tests.campaign.util import LLAMA_8B, edited, raw


def _campaign(tasks: int | None, **changes):
    doc = raw(LLAMA_8B) if tasks is None else edited(raw(LLAMA_8B), {"data.array_tasks": tasks})
    return campaign_from_dict(edited(doc, changes) if changes else doc)


def _script(kwargs: dict) -> str:
    key = "pp-tokenize-0123456789abcdef"
    return render_script(build_spec(key, f"/runs/{key}", kwargs["command"], kwargs["job"],
                                    {"PP_PYTHON": "/venv/bin/python", **kwargs["environment"]}))


def test_one_task_by_default_renders_the_single_job():
    campaign = _campaign(None)
    assert campaign.data.array_tasks == 1
    assert stages.tokenize_array(campaign, Layout.for_campaign(campaign)) is None
    script = _script(stages.tokenize(campaign, Layout.for_campaign(campaign)))
    assert "--array" not in script and "--merge-tasks" not in script
    assert "--workers 32 --merge corpus" in script


def test_array_tasks_render_an_array_and_a_merge():
    campaign = _campaign(3)
    layout = Layout.for_campaign(campaign)
    array = stages.tokenize_array(campaign, layout)
    assert array["tasks"] == 3
    script = _script(array)
    assert "#SBATCH --array=0-2\n" in script and "#SBATCH --cpus-per-task=32\n" in script
    assert "--workers 32 --array-tasks 3 --result result.json" in script
    assert "--merge " not in script  # a task writes no merged prefix and no manifest
    merge = _script(stages.tokenize(campaign, layout))
    assert "--array" not in merge.replace("--merge-tasks", "")
    assert "--merge corpus --merge-tasks 3 --result result.json" in merge
    # the merge copies, it does not encode: the data stage's own CPUs, not the workers'
    assert "#SBATCH --cpus-per-task=32\n" not in merge


def test_the_dag_keeps_its_task_ids_and_the_tokenize_task_runs_the_array_first():
    from operators.campaign.dag.dag_factory import build_dag
    from operators.campaign.dag.stage_operator import ArrayFirst

    one, three = (build_dag(_campaign(n), auto_register=False) for n in (None, 3))
    assert sorted(one.task_ids) == sorted(three.task_ids)
    task = three.get_task("data.tokenize")
    assert isinstance(task, ArrayFirst) and task.array_job["tasks"] == 3
    assert not isinstance(one.get_task("data.tokenize"), ArrayFirst)


def test_ingest_of_a_source_on_the_cluster_renders_an_array_and_a_merge():
    campaign = _campaign(3, **{"data.source": "/data/fineweb/*.parquet"})
    layout = Layout.for_campaign(campaign)
    array = stages.ingest_array(campaign, layout)
    assert array["tasks"] == 3
    script = _script(array)
    assert "#SBATCH --array=0-2\n" in script
    assert "--input '/data/fineweb/*.parquet' --output-dir" in script
    assert "--array-tasks 3 --result result.json" in script
    merge = _script(stages.ingest(campaign, layout))
    assert "#SBATCH --array" not in merge
    assert "--merge-tasks 3 --result result.json" in merge
    from operators.campaign.dag.dag_factory import build_dag
    from operators.campaign.dag.stage_operator import ArrayFirst

    task = build_dag(campaign, auto_register=False).get_task("data.ingest")
    assert isinstance(task, ArrayFirst) and task.array_job["tasks"] == 3


def test_a_remote_source_is_ingested_by_one_job_and_tokenized_by_the_array():
    campaign = _campaign(3)  # hf://datasets/HuggingFaceFW/fineweb/...: fetched into one folder
    layout = Layout.for_campaign(campaign)
    assert stages.ingest_array(campaign, layout) is None
    assert "--merge-tasks" not in _script(stages.ingest(campaign, layout))
    assert stages.tokenize_array(campaign, layout)["tasks"] == 3


def test_task_result_names_match_what_the_job_writes():
    from jobscripts.array_task import task_result_path
    from operators.campaign.dag.stage_operator import task_result_name

    assert task_result_name("result.json", 4) == "result_4.json"
    assert task_result_path("result.json", 4) == "result_4.json"
    assert task_result_path("/runs/x/result.json", 0) == "/runs/x/result_0.json"


@pytest.mark.parametrize("value, message", [
    (0, "data.array_tasks"), (1001, "data.array_tasks: 1001 tasks is more than Slurm's default "
                                    "MaxArraySize allows (at most 1000)"),
    ("many", "data.array_tasks")])
def test_array_tasks_is_validated_naming_the_field(value, message):
    with pytest.raises(CampaignConfigError) as err:
        _campaign(value)
    assert message in str(err.value)
