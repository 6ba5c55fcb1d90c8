"""Pure pieces: blends, the tiktoken translation's limits, the JSONL scan, the CLI contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobscripts import blend


def test_blend_renders_megatrons_flat_list():
    entries = [(30, "/d/a_text_document"), {"weight": "70", "prefix": "/d/b_text_document"}]
    assert blend.render(entries) == ["30", "/d/a_text_document", "70", "/d/b_text_document"]
    assert blend.render([(0.25, "/x")]) == ["0.25", "/x"]
    assert [w for w, _p in blend.normalized(entries)] == [0.3, 0.7]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([], "empty"),
        ([(0, "/a")], "positive"),
        ([(-1, "/a")], "positive"),
        ([("nan", "/a")], "positive"),
        ([("abc", "/a")], "not a number"),
        ([(1, "/a"), (2, "/a")], "twice"),
        ([(1, "/a.bin")], ".bin"),
        ([(1, "")], "non-empty"),
        ([(1,)], "expected"),
        ([{"weight": 1}], "missing"),
    ],
)
def test_blend_rejects_bad_entries(entries, message):
    with pytest.raises(blend.BlendError, match=message):
        blend.validate(entries)


def test_blend_reports_prefixes_missing_on_the_cluster(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"")
    (tmp_path / "b.bin").write_bytes(b"")
    entries = [(1, str(tmp_path / "a")), (1, str(tmp_path / "b"))]
    assert blend.missing_prefixes(entries) == [str(tmp_path / "b")]


def tokenizer_json(tmp_path: Path, **changes) -> Path:
    """A tiny byte-level BPE, with ``changes`` applied to its JSON."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, hello there"] * 20, trainer=trainer)
    data = json.loads(tok.to_str())
    data.update(changes)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    return path


def test_tiktoken_translation_refuses_what_it_cannot_express(tmp_path):
    from jobscripts.fast_encoder import HFEncoder, TiktokenEncoder, Unsupported, tiktoken_spec

    plain = tokenizer_json(tmp_path)
    text = "hello world <|endoftext|> héllo 123"
    assert (
        TiktokenEncoder(tiktoken_spec(plain)).encode(text).tolist()
        == HFEncoder(plain).encode(text).tolist()
    )
    with pytest.raises(Unsupported, match="normalizer"):
        tiktoken_spec(tokenizer_json(tmp_path, normalizer={"type": "Lowercase"}))
    prefix_space = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    with pytest.raises(Unsupported, match="prefix_space"):
        tiktoken_spec(tokenizer_json(tmp_path, pre_tokenizer=prefix_space))
    broken = tmp_path / "broken" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"model": {"type": "BPE", ')  # cut off: the sure path says what is wrong
    with pytest.raises(Unsupported, match=re.escape(str(broken))):
        tiktoken_spec(broken)


def test_a_merge_table_tiktoken_cannot_take_is_refused_naming_the_merge(tmp_path):
    from jobscripts.fast_encoder import HFEncoder, TiktokenEncoder, Unsupported, tiktoken_spec

    model = json.loads(tokenizer_json(tmp_path).read_text())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    first = merges[0]

    def with_merges(table) -> Path:
        return tokenizer_json(tmp_path, model={**model, "merges": table})

    for table, message in [
        ([*merges, first], f"two merges make {''.join(first.split())!r}"),
        ([merges[0], "ab", *merges[1:]], "merge 'ab' is not a pair"),
        ([*merges[:3], "a b c"], "merge 'a b c' is not a pair"),
        ([*merges[:3], "zz qq"], "merge 'zz qq' is not a pair making a token of the vocabulary"),
    ]:
        with pytest.raises(Unsupported, match=re.escape(message)):
            tiktoken_spec(with_merges(table))
    alien = {**model, "vocab": {**model["vocab"], "h\u03bb": 999}, "merges": [*merges, "h \u03bb"]}
    with pytest.raises(Unsupported, match="not in the byte-level alphabet"):
        tiktoken_spec(tokenizer_json(tmp_path, model=alien))
    # Both spellings of a merge, "a b" and ["a", "b"], and merges whose order is not their
    # ids' order (tiktoken ranks, then a lookup to HF ids): the ids stay HF's.
    swapped = [m.split(" ") for m in merges]
    swapped[1], swapped[2] = swapped[2], swapped[1]
    for table in (merges, swapped):
        path = with_merges(table)
        text = "hello world <|endoftext|> there, hello"
        assert TiktokenEncoder(tiktoken_spec(path)).encode(text).tolist() == (
            HFEncoder(path).encode(text).tolist()
        )
    assert tiktoken_spec(with_merges(swapped)).rank_to_id is not None


def test_each_encoding_thread_gets_its_own_tiktoken_encoding_and_the_same_ids(tmp_path):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from jobscripts.fast_encoder import HFEncoder, TiktokenEncoder, tiktoken_spec

    plain = tokenizer_json(tmp_path)
    encoder = TiktokenEncoder(tiktoken_spec(plain))
    texts = [f"hello world {i} <|endoftext|> there" for i in range(64)]
    with ThreadPoolExecutor(2) as pool:
        # Two tasks block on each other, so each is sure to run on its own thread.
        barrier = threading.Barrier(2)

        def encoding_of_this_thread(_):
            barrier.wait(timeout=10)
            return encoder.encoding

        encodings = list(pool.map(encoding_of_this_thread, range(2)))
        ids = list(pool.map(lambda text: encoder.encode(text).tolist(), texts))
    assert encodings[0] is not encodings[1]  # no Encoding (and regex scratch pool) shared
    assert encoder.encoding is encoder.encoding  # built once per thread, then kept
    hf = HFEncoder(plain)
    assert ids == [hf.encode(text).tolist() for text in texts]


def test_jsonl_scan_reports_each_bad_line_and_samples_deterministically(tmp_path):
    from jobscripts.jsonl_scan import scan

    lines = [json.dumps({"id": i, "text": f"doc {i}"}).encode() for i in range(50)]
    lines[10] = b"\xff\xfe not utf-8"
    lines[20] = b"[1, 2]"
    lines[30] = b'{"id": 30, "text": "lone \\ud800 surrogate"}'
    lines[40] = b'{"id": 40, "text": 42}'
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    result = scan([tmp_path / "a.jsonl"], sample_size=10, seed=3)
    assert [(i.line, i.reason.split(" ")[0]) for i in result.issues] == [
        (11, "invalid"),
        (21, "a"),
        (31, "lone"),
        (41, "field"),
        (51, "blank"),
    ]
    assert result.lines == 51 and len(result.rows) == 10
    again = scan([tmp_path / "a.jsonl"], sample_size=10, seed=3)
    assert [r["line"] for r in again.rows] == [r["line"] for r in result.rows]
    assert len(scan([tmp_path / "a.jsonl"], sample_size=10, seed=3, full=True).rows) == 46


def test_entry_point_writes_a_failure_result_and_exits_nonzero(tmp_path):
    result = tmp_path / "blend.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobscripts.blend",
            "--blend",
            "0",
            "/nope",
            "--result",
            str(result),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=60,
    )
    assert proc.returncode == 1
    payload = json.loads(result.read_text())
    assert payload["ok"] is False and "must be positive" in payload["error"]
    assert payload["step"] == "blend" and "FAILED" in proc.stdout


def test_hub_check_fails_fast_without_a_route(monkeypatch):
    from jobscripts.common import StepError
    from jobscripts.hf_fetch import check_online

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on discard
    started = time.monotonic()
    with pytest.raises(StepError, match="127.0.0.1:9 is unreachable"):
        check_online(timeout=2)
    assert time.monotonic() - started < 3


def test_stop_process_group_escalates_to_the_signal_the_group_obeys() -> None:
    """A group whose processes ignore SIGINT (a child outliving its leader's clean stop) ends
    on the next step; with only SIGINT it is still there, and the call says so."""
    import signal

    from jobscripts.common import process_group_alive, stop_process_group

    # Started through a shell that exits: the group's leader is not this test's child, so it
    # leaves no zombie behind (as the demo's servers, started by an earlier command).
    group = "trap '' INT; sleep 60 & wait"
    started = subprocess.run(["sh", "-c", f'setsid sh -c "{group}" >/dev/null 2>&1 & echo $!'],
                             capture_output=True, text=True, check=True)
    pgid = int(started.stdout)
    try:
        time.sleep(0.3)
        assert stop_process_group(pgid, ((signal.SIGINT, 1),)) is False
        assert process_group_alive(pgid)
        assert stop_process_group(pgid, ((signal.SIGINT, 1), (signal.SIGTERM, 10))) is True
        assert not process_group_alive(pgid)
    finally:
        stop_process_group(pgid, ((signal.SIGKILL, 5),))
