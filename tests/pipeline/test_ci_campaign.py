"""A whole campaign on the local cluster under ``airflow dags test``.

Data stage (demo corpus -> ingest -> raw gate -> BPE tokenizer -> Megatron tokenization ->
tokenized gate) then three chained training segments of the reference trainer. Segment 2 is
cut by SIGTERM mid-way (as Slurm's ``--signal`` does before a time limit); segment 3 resumes
from its checkpoint and finishes. The split run must equal an uncut run iteration by iteration.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from operators.campaign import logparse
from tests.support import cluster
from tests.support.airflow import dags_test
from tests.trainer.conftest import losses, run_trainer

pytestmark = pytest.mark.cluster
DAG_ID = "pretrain__ci_campaign"
CAMPAIGN = Path("/home/pretrain/pp-test-campaigns/ci_campaign")
RUNS = Path("/home/pretrain/pp-runs")
ITERATION = re.compile(r"iteration\s+(\d+)/")


def _signal_segment_2(stop: threading.Event, sent: dict) -> None:
    """SIGTERM segment 2's trainer once it has trained its first iteration."""
    while not stop.is_set():
        out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            job_id, name = line.split()
            if not name.startswith("pp-train.segment_2-"):
                continue
            log = RUNS / name / f"slurm-{job_id}.out"
            if log.exists() and ITERATION.search(log.read_text(errors="replace")):
                subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
                sent["job_id"] = job_id
                return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def campaign_run(dags_test_env):
    cluster.remote(f"rm -rf {CAMPAIGN}")
    stop, sent = threading.Event(), {}
    watcher = threading.Thread(target=_signal_segment_2, args=(stop, sent), daemon=True)
    watcher.start()
    try:
        proc = dags_test(dags_test_env, DAG_ID, timeout=1500)
    finally:
        stop.set()
    history = [json.loads(line) for line in (CAMPAIGN / "segments.jsonl").read_text()
               .splitlines()] if (CAMPAIGN / "segments.jsonl").exists() else []
    return proc, history, sent


def test_campaign_succeeds_through_data_stage_and_three_segments(campaign_run) -> None:
    proc, history, sent = campaign_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "job_id" in sent, "segment 2 was never signalled"
    assert [h["stop_reason"] for h in history] == ["time_limit", "signal", "completed"]
    ends = [h["end_iteration"] for h in history]
    assert ends[0] == 15 and 15 < ends[1] < 30 and ends[2] == 30
    assert [h["start_iteration"] for h in history] == [0, ends[0], ends[1]]
    assert (CAMPAIGN / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert history[1]["slurm"]["job_id"] == sent["job_id"]


def test_gates_passed_and_manifest_pinned(campaign_run) -> None:
    data = CAMPAIGN / "data"
    manifest = json.loads((data / "manifest.json").read_text())
    assert json.loads((CAMPAIGN / "pinned_manifest.json").read_text()) == manifest
    assert manifest["total"]["documents"] > 100 and manifest["total"]["tokens"] > 100_000
    for stage in ("raw_gate", "token_gate"):
        result = json.loads((_newest_run_dir(f"data.{stage}") / "result.json").read_text())
        assert result["ok"] is True, stage
    assert any((data / "raw_gate").rglob("*.html"))  # GX Data Docs


def test_every_document_decodes_back_to_its_text(campaign_run) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    data = CAMPAIGN / "data"
    tokenizer = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    texts = [json.loads(line)["text"] for shard in sorted((data / "ingest" / "jsonl").rglob(
        "*.jsonl*")) for line in _lines(shard)]
    dataset = IndexedDataset(str(data / "corpus_text_document"))
    assert len(dataset) == len(texts)
    eod = json.loads((data / "manifest.json").read_text())["settings"]["eod_id"]
    for i, text in enumerate(texts):
        ids = dataset[i].tolist()
        assert ids[-1] == eod, i
        assert tokenizer.decode(ids[:-1], skip_special_tokens=False) == text, i


def _newest_run_dir(task_id: str) -> Path:
    """This campaign's latest job directory for ``task_id`` (other DAGs share task ids)."""
    mine = [p for p in RUNS.glob(f"pp-{task_id}-*") if str(CAMPAIGN) in
            (p / "job.sbatch").read_text()]
    return max(mine, key=lambda p: p.stat().st_mtime)


def _lines(path: Path) -> list[str]:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [line for line in handle if line.strip()]


def _segment_logs(history: list[dict]) -> str:
    return "\n".join(Path(h["log_path"]).read_text() for h in history)


def test_no_iteration_trained_twice_and_loss_falls(campaign_run) -> None:
    train = losses(_segment_logs(campaign_run[1]))  # asserts that no iteration appears twice
    assert sorted(train) == list(range(1, 31))
    first, last = sum(train[i] for i in (1, 2, 3)) / 3, sum(train[i] for i in (28, 29, 30)) / 3
    assert last < first - 0.5  # nats/token; about 0.95 in the runs seen here


def test_split_run_matches_uncut_run(campaign_run, tmp_path) -> None:
    history = campaign_run[1]
    config = json.loads((Path(history[0]["run_dir"]) / "run.json").read_text())
    config.update(save=str(tmp_path / "ckpt"), data_cache_path=str(tmp_path / "cache"),
                  segment_result=str(tmp_path / "segment.json"), exit_interval=None,
                  exit_duration_in_mins=None)
    uncut = losses(run_trainer(tmp_path, config).log)
    split = losses(_segment_logs(history))
    assert sorted(uncut) == sorted(split)
    for iteration, loss in split.items():
        assert math.isclose(loss, uncut[iteration], rel_tol=1e-6), iteration
    assert logparse  # the parser above is the one the DAG uses for MLflow


def test_export_and_evaluation_ran_on_the_cluster(campaign_run) -> None:
    export = CAMPAIGN / "export" / "hf"
    assert (export / "config.json").exists() and (export / "tokenizer.json").exists()
    run_dir = _newest_run_dir("export")
    result = json.loads((run_dir / "result.json").read_text())
    assert result["ok"] and result["iteration"] == 30
    assert result["verification"]["max_abs_logit_diff"] <= result["verification"]["atol"]
    run_dir = _newest_run_dir("evaluate")
    evaluation = json.loads((run_dir / "result.json").read_text())
    assert evaluation["ok"] and math.isfinite(evaluation["perplexity"])
    # Better than a uniform guess over the 1,024-token vocabulary after 30 iterations.
    assert evaluation["perplexity"] < 1024 and evaluation["bits_per_byte"] > 0
    assert {s["temperature"] for s in evaluation["samples"]} == {0.0, 0.8}
