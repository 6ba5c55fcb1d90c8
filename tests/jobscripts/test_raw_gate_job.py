"""The raw-data gate as a real Slurm job on JSONL that ingest could never write: malformed lines,
invalid UTF-8, and a file that is not UTF-8 at all. (Ingest writes well-formed JSONL from
Parquet, so these reach the gate only from a corpus handed over as JSONL.)"""

from __future__ import annotations

import json
import posixpath
import uuid

import pytest

from operators.campaign.render.layout import RESULT_FILE
from operators.slurm.operator import PYTHON_ENV, build_spec, log_path_for, python_module_command
from operators.slurm.states import Outcome, classify
from tests.support import cluster
from tests.support.data_stage import bad_corpus

pytestmark = pytest.mark.cluster



def test_gate_job_fails_naming_lines_and_the_non_utf8_file(hook, tmp_path) -> None:
    bad_corpus(tmp_path / "bad.jsonl")
    docs = [json.dumps({"id": str(i), "text": f"document number {i} " * 5}) for i in range(20)]
    utf16 = "\n".join(docs).encode("utf-16")
    key = f"pp-test-raw-gate-{uuid.uuid4().hex[:8]}"
    run_dir = hook.run_dir(key)
    corpus = posixpath.join(run_dir, "corpus")
    hook.upload(corpus, {"bad.jsonl": (tmp_path / "bad.jsonl").read_bytes(),
                         "utf16.jsonl": utf16})
    command = python_module_command("jobscripts.raw_gate", "--input", corpus,
                                    "--output-dir", posixpath.join(run_dir, "gate"),
                                    "--max-duplicate-rate", "0.05", "--result", RESULT_FILE)
    spec = build_spec(key, run_dir, command, {"time": "5", "cpus_per_task": 1},
                      {PYTHON_ENV: hook.settings.remote_python})
    job_id = hook.submit(spec, run_dir)

    def ended():
        record = hook.describe(job_id)
        return record if record and record.source == "sacct" and \
            classify(record.state).terminal else None
    record = cluster.wait_for(ended, 300, f"gate job {job_id}", interval=2)
    assert classify(record.state) is Outcome.FAILURE and record.exit_code == 1
    result = hook.read_json(posixpath.join(run_dir, RESULT_FILE))
    error = result["error"]
    assert result["ok"] is False
    assert "bad.jsonl:4: invalid UTF-8" in error and "bad.jsonl:7: malformed JSON" in error
    lines = next(e for e in result["expectations"] if e["name"] == "lines_valid")
    assert "utf16.jsonl: not UTF-8 JSONL at all" in str(lines["examples"])
    log = hook.log_tail(log_path_for(spec, job_id))
    assert "raw gate failed" in log, log
