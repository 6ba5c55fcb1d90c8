"""Tokenizer, Megatron tokenization (identity with a reference, round trip, resume), token gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.data_stage import VOCAB, ok, run_main, tokenize_argv


def reference_write(jsonl: Path, tokenizer, prefix: Path) -> None:
    """What preprocess_data does, written out plainly: one tokenize per document, one builder."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    for line in jsonl.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        ids, lengths = [], []
        for sentence in text if isinstance(text, list) else [text]:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}.idx")


def same_files(a: Path, b: Path) -> bool:
    return all(
        Path(f"{a}{s}").read_bytes() == Path(f"{b}{s}").read_bytes() for s in (".bin", ".idx")
    )


def test_trained_tokenizer_loads_in_transformers_and_megatron(tokenizer, megatron_tokenizer):
    from transformers import AutoTokenizer

    assert tokenizer["vocab_size"] == VOCAB and tokenizer["fast_encoder"] == "tiktoken"
    auto = AutoTokenizer.from_pretrained(tokenizer["tokenizer_dir"])
    assert auto.eos_token == auto.bos_token == "<|endoftext|>" and auto.pad_token == "<|pad|>"
    assert megatron_tokenizer.eod == auto.eos_token_id == tokenizer["eod_id"] == 0
    assert megatron_tokenizer.bos == 0 and megatron_tokenizer.pad == 1
    assert megatron_tokenizer.vocab_size == len(auto) == VOCAB
    text = "Tokenizers round-trip: ünïcode, 数字 123, and <|endoftext|> too."
    assert auto.decode(megatron_tokenizer.tokenize(text)) == text


def test_given_tokenizer_directory_is_validated_and_copied(tokenizer, tmp_path):
    from jobscripts.train_tokenizer import main

    argv = ["--from-dir", tokenizer["tokenizer_dir"], "--output-dir", str(tmp_path / "tok")]
    result = ok(main, argv, tmp_path / "r.json")
    assert result["tokenizer_sha256"] == tokenizer["tokenizer_sha256"] and result["eod_id"] == 0
    argv = ["--from-dir", str(tmp_path), "--output-dir", str(tmp_path / "x")]
    code, result, _ = run_main(main, argv, tmp_path / "r2.json")
    assert code == 1 and "no tokenizer.json" in result["error"]


def test_tokenized_output_is_byte_identical_to_reference(
    tokenized, ingested, megatron_tokenizer, work, tmp_path
):
    assert tokenized["encoder"]["encoder"] == "tiktoken" and tokenized["dtype"] == "uint16"
    for jsonl in ingested["jsonl_files"]:
        stem = Path(jsonl).name.removesuffix(".jsonl")
        reference_write(Path(jsonl), megatron_tokenizer, tmp_path / stem)
        assert same_files(work / "tokens" / f"{stem}_text_document", tmp_path / stem), stem


def test_edge_cases_are_identical_with_every_encoder(tokenizer, megatron_tokenizer, tmp_path):
    from jobscripts.tokenize_megatron import main

    docs = ["plain text", "", " ", "<|endoftext|> inside <|endoftext|>", ["two", "", "sentences"],
            [], "tabs\t\tand\r\nnewlines\n\n", "😀 ünïcode 日本語", "x" * 3000]  # fmt: skip
    src = tmp_path / "edge.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    reference_write(src, megatron_tokenizer, tmp_path / "reference")
    for encoder in ("tiktoken", "hf", "reference"):
        out = tmp_path / encoder
        argv = tokenize_argv(src, tokenizer["tokenizer_dir"], out, "--encoder", encoder)
        ok(main, argv, tmp_path / f"{encoder}.json")
        assert same_files(out / "edge_text_document", tmp_path / "reference"), encoder


def test_a_tokenizer_tiktoken_cannot_express_stops_the_check_and_goes_the_sure_way(
    tokenizer, tmp_path
):
    import multiprocessing

    from tokenizers import Tokenizer, normalizers

    from jobscripts.megatron_tokenizer import load
    from jobscripts.tokenize_megatron import main

    # The check is forked before tiktoken's spec is built; a normalizer makes that spec
    # Unsupported, so the fast start must stop the child it forked and tokenize the sure way.
    tok_dir = tmp_path / "nfc_tokenizer"
    shutil.copytree(tokenizer["tokenizer_dir"], tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.normalizer = normalizers.NFC()
    tok.save(str(tok_dir / "tokenizer.json"))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b c", "", "cafe\u0301 x"]))
    reference_write(src, load(tok_dir), tmp_path / "reference")
    result = ok(main, tokenize_argv(src, tok_dir, tmp_path / "out"), tmp_path / "r.json")
    assert result["encoder"]["encoder"] == "hf"
    assert same_files(tmp_path / "out" / "docs_text_document", tmp_path / "reference")
    assert multiprocessing.active_children() == []  # the forked check did not outlive it


def test_legacy_tokenizer_mode_keeps_the_post_processors_bos(tokenizer, tmp_path):
    from tokenizers import Tokenizer, processors

    from jobscripts.megatron_tokenizer import LegacyHFTokenizer
    from jobscripts.tokenize_megatron import main

    # A Llama-3-like tokenizer: its post-processor puts BOS (id 0 here) before every text.
    tok_dir = tmp_path / "bos_tokenizer"
    shutil.copytree(tokenizer["tokenizer_dir"], tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.save(str(tok_dir / "tokenizer.json"))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b c", "", "x <|pad|> y"]))
    reference_write(src, LegacyHFTokenizer(str(tok_dir)), tmp_path / "reference")
    for encoder in ("tiktoken", "reference"):
        out = tmp_path / encoder
        argv = tokenize_argv(src, tok_dir, out, "--legacy-tokenizer", "--encoder", encoder)
        ok(main, argv, tmp_path / f"{encoder}.json")
        assert same_files(out / "docs_text_document", tmp_path / "reference"), encoder
    tokens = np.fromfile(tmp_path / "tiktoken" / "docs_text_document.bin", dtype=np.uint16)
    assert tokens[0] == 0 and tokens[-1] == 0  # BOS first, EOD last; "" became [BOS, EOD]


def test_every_document_decodes_back_to_its_text(tokenized, ingested, tokenizer, work):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    decoder = Tokenizer.from_file(str(Path(tokenizer["tokenizer_dir"]) / "tokenizer.json"))
    for jsonl in ingested["jsonl_files"]:
        texts = [json.loads(x)["text"] for x in Path(jsonl).read_text().splitlines()]
        stem = Path(jsonl).name.removesuffix(".jsonl")
        dataset = IndexedDataset(str(work / "tokens" / f"{stem}_text_document"))
        docs = dataset.document_indices
        assert len(docs) - 1 == len(texts)
        for i, text in enumerate(texts):
            ids = np.concatenate([dataset[s] for s in range(docs[i], docs[i + 1])])
            assert ids[-1] == tokenizer["eod_id"]
            assert decoder.decode(ids[:-1].tolist(), skip_special_tokens=False) == text


def test_rerun_skips_finished_shards_and_redoes_a_broken_one(tokenized, tokenizer, work, tmp_path):
    from jobscripts.manifest import load
    from jobscripts.tokenize_megatron import main

    out = tmp_path / "tokens"
    shutil.copytree(work / "tokens", out)
    argv = tokenize_argv(work / "ingest" / "jsonl", tokenizer["tokenizer_dir"], out)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*_text_document.*")}
    result = ok(main, argv, tmp_path / "r1.json")
    assert result["skipped_shards"] == 2 and result["tokenized_shards"] == 0
    assert before == {p.name: p.stat().st_mtime_ns for p in out.glob("*_text_document.*")}
    assert result["manifest_fingerprint"] == tokenized["manifest_fingerprint"]
    # a shard whose .bin was cut short (a killed job) is redone, the other one is not
    with open(out / "00001_text_document.bin", "r+b") as handle:
        handle.truncate(10)
    result = ok(main, argv, tmp_path / "r2.json")
    assert result["skipped_shards"] == 1 and result["tokenized_shards"] == 1
    assert load(out / "manifest.json")["fingerprint"] == tokenized["manifest_fingerprint"]


def test_manifest_records_what_tokenization_wrote(tokenized, tokenizer, work):
    from jobscripts.manifest import load
    from jobscripts.megatron_tokenizer import sha256_file

    manifest = load(work / "tokens" / "manifest.json")
    assert manifest["settings"]["tokenizer_sha256"] == tokenizer["tokenizer_sha256"]
    assert manifest["settings"]["vocab_size"] == VOCAB and manifest["settings"]["eod_id"] == 0
    for entry in manifest["prefixes"]:
        prefix = work / "tokens" / entry["prefix"]
        assert entry["idx_sha256"] == sha256_file(f"{prefix}.idx")
        assert entry["bin_bytes"] == Path(f"{prefix}.bin").stat().st_size == 2 * entry["tokens"]
    assert manifest["total"]["tokens"] == tokenized["tokens"]


def test_merge_concatenates_shards(tokenized, tokenizer, work, tmp_path):
    from jobscripts.tokenize_megatron import main

    out = tmp_path / "merged"
    shutil.copytree(work / "tokens", out)
    argv = tokenize_argv(
        work / "ingest" / "jsonl", tokenizer["tokenizer_dir"], out, "--merge", "all"
    )
    result = ok(main, argv, tmp_path / "r.json")
    assert result["skipped_shards"] == 2
    merged = (out / "all_text_document.bin").read_bytes()
    assert merged == b"".join((out / f"0000{i}_text_document.bin").read_bytes() for i in range(2))
    assert result["documents"] == tokenized["documents"]


def test_changed_manifest_is_detected(tokenized, tokenizer, work, tmp_path):
    from jobscripts.manifest import ManifestError, assert_same, load
    from jobscripts.tokenize_megatron import main

    pinned = load(work / "tokens" / "manifest.json")
    assert_same(pinned, load(work / "tokens" / "manifest.json"))
    # the corpus changes: one more document in shard 00001
    src = tmp_path / "jsonl"
    shutil.copytree(work / "ingest" / "jsonl", src)
    with open(src / "00001.jsonl", "a") as handle:
        handle.write(json.dumps({"text": "one more document"}) + "\n")
    out = tmp_path / "tokens"
    ok(main, tokenize_argv(src, tokenizer["tokenizer_dir"], out), tmp_path / "r.json")
    with pytest.raises(ManifestError) as info:
        assert_same(pinned, load(out / "manifest.json"))
    message = str(info.value)
    assert "prefix 00001_text_document: documents pinned" in message and "idx_sha256" in message
    assert "00000_text_document" not in message
    # a hand-edited manifest is refused outright
    edited = json.loads((out / "manifest.json").read_text())
    edited["prefixes"][0]["tokens"] += 1
    (out / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ManifestError, match="fingerprint"):
        load(out / "manifest.json")


def test_token_gate_passes_on_the_tokenized_demo(tokenized, ingested, work):
    from jobscripts.token_gate import main

    argv = ["--dataset-dir", str(work / "tokens"), "--ingest-result", str(work / "ingest.json")]
    result = ok(main, argv, work / "token_gate.json")
    assert result["total"]["documents"] == ingested["docs_out"]
    assert result["total"]["tokens"] == tokenized["tokens"]
    assert 0.1 < result["total"]["tokens_per_byte"] < 1.0


def test_token_gate_names_prefix_and_first_bad_document(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from jobscripts.token_gate import main

    prefix = tmp_path / "bad_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for ids in ([5, 6, 0], [7, 0], [], [8, 9], [3, 900, 0], [4, 0]):
        builder.add_document(ids, [len(ids)] if ids else [])
    builder.finalize(f"{prefix}.idx")
    argv = ["--prefix", str(prefix), "--vocab-size", "500", "--eod-id", "0"]
    code, result, _ = run_main(main, [*argv, "--expected-documents", "5"], tmp_path / "r.json")
    assert code == 1
    error = result["error"]
    assert str(prefix) in error
    assert "6 documents, expected 5" in error
    assert "document 2 is empty" in error
    assert "document 3 does not end with EOD 0 (last id 9" in error
    assert "document 4: id 900" in error


def test_tokenize_names_the_line_it_cannot_read(tokenizer, tmp_path):
    from jobscripts.tokenize_megatron import main

    src = tmp_path / "broken.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": null}\n')
    argv = tokenize_argv(src, tokenizer["tokenizer_dir"], tmp_path / "out")
    code, result, _ = run_main(main, argv, tmp_path / "r.json")
    assert code == 1 and f"{src}:3: field 'text' is NoneType" in result["error"]
    assert not (tmp_path / "out" / "manifest.json").exists()
    src.write_text('{"text": "fine"}\n{"text": "cut short\n')
    code, result, _ = run_main(main, argv, tmp_path / "r.json")
    assert code == 1 and f"{src}:2: cannot read 'text'" in result["error"]


def test_a_guess_megatron_rejects_is_redone_the_sure_way(
    tokenizer, megatron_tokenizer, monkeypatch, tmp_path
):
    from jobscripts import tokenize_megatron

    # Tokenization starts before Megatron's tokenizer is built, with the EOD read from the
    # files. Make that read wrong: the forked check must catch it and the shards be redone.
    real = tokenize_megatron.spec_and_facts
    monkeypatch.setattr(tokenize_megatron, "spec_and_facts", lambda d: (*real(d)[:2], 1))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(5)))
    argv = tokenize_argv(src, tokenizer["tokenizer_dir"], tmp_path / "out")
    code, result, log = run_main(tokenize_megatron.main, argv, tmp_path / "r.json")
    assert code == 0, result
    assert "Megatron disagrees" in log and result["eod_id"] == 0
    reference_write(src, megatron_tokenizer, tmp_path / "reference")
    assert same_files(tmp_path / "out" / "docs_text_document", tmp_path / "reference")
