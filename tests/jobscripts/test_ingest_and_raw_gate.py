"""Demo corpus -> ingest -> raw gate, and a bad corpus that the raw gate must stop."""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.support.data_stage import bad_corpus, run_main


def test_demo_corpus_has_fineweb_layout_and_is_deterministic(demo_parquet, tmp_path):
    from jobscripts.demo_corpus import main

    files = sorted(Path(demo_parquet["output_dir"]).glob("*.parquet"))
    assert len(files) == 2 and demo_parquet["text_bytes"] >= 250_000
    columns = pq.read_schema(files[0]).names
    assert {"text", "id", "url", "source"} <= set(columns)
    # same seed and size -> same documents; another seed -> another selection
    argv = ["--target-bytes", "60000", "--shards", "1"]
    run_main(main, [*argv, "--output-dir", str(tmp_path / "a")], tmp_path / "a.json")
    run_main(main, [*argv, "--output-dir", str(tmp_path / "b")], tmp_path / "b.json")
    run_main(main, [*argv, "--seed", "7", "--output-dir", str(tmp_path / "c")], tmp_path / "c.json")
    a, b, c = (
        pq.read_table(tmp_path / x / "000_00000.parquet").column("id").to_pylist() for x in "abc"
    )
    assert a == b and a != c


def test_ingest_writes_jsonl_and_counts(ingested, demo_parquet):
    assert ingested["docs_in"] == demo_parquet["documents"] == ingested["docs_out"]
    assert ingested["dropped"] == {"empty": 0, "too_short": 0, "too_long": 0, "duplicate": 0}
    lines = [
        json.loads(x) for f in ingested["jsonl_files"] for x in Path(f).read_text().splitlines()
    ]
    assert len(lines) == ingested["docs_out"] and all(d["text"] and d["id"] for d in lines)
    assert all(f.endswith(".jsonl") for f in ingested["jsonl_files"])  # uncompressed: seekable


def test_ingest_filters_each_reason_and_dedups_deterministically(tmp_path):
    from jobscripts.ingest import main

    rows = [
        ("keep me, I am long enough", "a"),
        ("", "b"),
        (None, "c"),
        ("duplicate text here", "d"),
        ("duplicate text here", "e"),
        ("tiny", "f"),
        ("x" * 500, "g"),
        ("another fine document", "h"),
    ]
    src = tmp_path / "in"
    src.mkdir()
    table = pa.table({"text": [r[0] for r in rows], "id": [r[1] for r in rows]})
    pq.write_table(table.slice(0, 4), src / "000_00000.parquet")
    pq.write_table(table.slice(4), src / "000_00001.parquet")
    argv = [
        "--input",
        str(src / "*.parquet"),
        "--min-chars",
        "5",
        "--max-chars",
        "100",
        "--workers",
        "1",
    ]
    code, result, _ = run_main(
        main, [*argv, "--output-dir", str(tmp_path / "o1")], tmp_path / "r1.json"
    )
    assert code == 0, result
    assert result["docs_in"] == 8 and result["docs_out"] == 3
    assert result["dropped"] == {"empty": 2, "too_short": 1, "too_long": 1, "duplicate": 1}
    texts = [
        json.loads(x)["text"]
        for f in result["jsonl_files"]
        for x in Path(f).read_text().splitlines()
    ]
    assert sorted(texts) == sorted(
        ["keep me, I am long enough", "duplicate text here", "another fine document"]
    )
    # deterministic: a second run in another directory writes the same bytes
    run_main(main, [*argv, "--output-dir", str(tmp_path / "o2")], tmp_path / "r2.json")
    for name in ("00000.jsonl", "00001.jsonl"):
        assert (tmp_path / "o1/jsonl" / name).read_bytes() == (
            tmp_path / "o2/jsonl" / name
        ).read_bytes()
    # other settings into the same directory are refused, not silently resumed
    code, result, _ = run_main(
        main,
        [*argv[:-2], "--no-dedup", "--workers", "1", "--output-dir", str(tmp_path / "o1")],
        tmp_path / "r3.json",
    )
    assert code == 1 and "other settings" in result["error"]


def test_hf_download_fails_at_once_when_offline(tmp_path, monkeypatch):
    from jobscripts.ingest import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    code, result, _ = run_main(
        main,
        [
            "--hf-repo",
            "HuggingFaceFW/fineweb",
            "--hf-allow-pattern",
            "sample/10BT/000_*.parquet",
            "--output-dir",
            str(tmp_path),
        ],
        tmp_path / "r.json",
    )
    assert code == 1 and time.monotonic() - started < 5
    assert "HF_HUB_OFFLINE" in result["error"] and "offline" in result["error"]


def test_raw_gate_passes_on_demo_and_writes_data_docs(ingested, work):
    from jobscripts.raw_gate import main

    out = work / "raw_gate"
    code, result, log = run_main(
        main,
        ["--input", str(work / "ingest/jsonl"), "--output-dir", str(out)],
        out / "raw_gate.json",
    )
    assert code == 0, result.get("error", result)
    names = [e["name"] for e in result["expectations"]]
    assert names == [
        "lines_valid",
        "text_present",
        "text_length",
        "id_present",
        "id_unique",
        "duplicate_rate",
        "replacement_share",
        "nonprintable_share",
    ]
    assert all(
        e["success"] and "observed_value" in e and e["threshold"] for e in result["expectations"]
    )
    assert result["sampled"] == ingested["docs_out"]
    assert Path(result["data_docs"]).is_file() and "PASS duplicate_rate" in log


def test_raw_gate_stops_a_bad_corpus_with_reasons_and_lines(tmp_path):
    from jobscripts.raw_gate import main

    bad_corpus(tmp_path / "bad.jsonl")
    code, result, _ = run_main(
        main,
        [
            "--input",
            str(tmp_path / "bad.jsonl"),
            "--output-dir",
            str(tmp_path / "gate"),
            "--max-duplicate-rate",
            "0.05",
        ],
        tmp_path / "r.json",
    )
    assert code == 1 and result["ok"] is False
    error = result["error"]
    failed = {e["name"]: e for e in result["expectations"] if not e["success"]}
    assert set(failed) == {
        "lines_valid",
        "text_present",
        "text_length",
        "id_unique",
        "duplicate_rate",
        "replacement_share",
        "nonprintable_share",
    }
    assert "bad.jsonl:4: invalid UTF-8" in error and "bad.jsonl:7: malformed JSON" in error
    assert "bad.jsonl:2" in str(failed["text_present"]["examples"])
    assert "bad.jsonl:3" in str(failed["text_length"]["examples"])
    assert {"bad.jsonl:1", "bad.jsonl:8"} <= set(failed["id_unique"]["examples"])
    assert failed["duplicate_rate"]["observed_value"] > 0.05
    for name in failed:
        assert f"{name}: observed" in error
    assert Path(tmp_path / "gate/data_docs/index.html").is_file()


def test_raw_gate_names_a_file_that_is_not_utf8_at_all(tmp_path):
    """One verdict per such file, first, rather than one per line buried among thousands."""
    from jobscripts.raw_gate import main

    docs = [json.dumps({"id": f"d{i}", "text": f"Document number {i} is fine."})
            for i in range(20)]
    (tmp_path / "00000.jsonl").write_text("\n".join(docs) + "\n")
    (tmp_path / "00001.jsonl").write_bytes("\n".join(docs).encode("utf-16"))
    (tmp_path / "00002.jsonl").write_bytes(gzip.compress("\n".join(docs).encode()))
    code, result, _ = run_main(main, ["--input", str(tmp_path), "--output-dir",
                                      str(tmp_path / "gate")], tmp_path / "r.json")
    assert code == 1
    (lines,) = [e for e in result["expectations"] if not e["success"]]
    assert lines["name"] == "lines_valid"
    assert lines["examples"][0] == (
        "00001.jsonl: not UTF-8 JSONL at all: none of its 20 lines is a JSON object in UTF-8; "
        "it looks like UTF-16 text (little-endian byte order mark)")
    assert re.fullmatch(r"00002\.jsonl: not UTF-8 JSONL at all: none of its \d+ lines is a "
                        r"JSON object in UTF-8; it looks like gzip-compressed",
                        lines["examples"][1])
    assert result["error"].startswith("raw gate failed 1 of 8 checks: lines_valid: observed ")
    assert "(e.g. 00001.jsonl: not UTF-8 JSONL at all" in result["error"]
    assert " more)" in result["error"]  # five examples quoted, the rest counted
    # a shard set with nothing readable at all stops before GX, naming the file
    (tmp_path / "00000.jsonl").unlink()
    (tmp_path / "00002.jsonl").unlink()
    code, result, _ = run_main(main, ["--input", str(tmp_path), "--output-dir",
                                      str(tmp_path / "gate")], tmp_path / "r.json")
    assert code == 1 and result["error"].startswith(
        f"no valid document in {tmp_path}: 00001.jsonl: not UTF-8 JSONL at all")
