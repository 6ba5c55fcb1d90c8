"""Tokenized-data gate: check the ``.bin/.idx`` through megatron-core's IndexedDataset.

    python -m jobscripts.token_gate --dataset-dir OUT [--ingest-result OUT/ingest.json]
    python -m jobscripts.token_gate --prefix P [--prefix P2 ...] --vocab-size V --eod-id E
        [--expected-documents N]
        [--output-dir DIR] [--chunk-tokens 16777216] [--result PATH]

Per prefix: the index agrees with the .bin size, no document is empty, every
document ends with EOD, every id is below the vocabulary size (and not negative),
the document count equals what tokenization recorded in manifest.json (and, with
``--ingest-result``, the total equals ingest's ``docs_out``). Reports total
tokens and tokens per byte of text. Everything is vectorised numpy over the
memory-mapped tokens, a chunk at a time, so memory stays flat.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from jobscripts import manifest as manifest_lib
from jobscripts.common import StepError, entry_point, log
from jobscripts.job_files import MANIFEST_FILE
from jobscripts.results import read_json


def first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def check_prefix(
    prefix: str,
    vocab_size: int,
    eod: int,
    expected_documents: int | None,
    chunk_tokens: int = 1 << 24,
) -> dict:
    """Figures and problems (each naming the first bad document) for one prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    dtype = dataset.index.dtype
    seq_lengths = dataset.sequence_lengths.astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(seq_lengths)])  # token offset of each sequence start
    docs = dataset.document_indices
    starts, ends = bounds[docs[:-1]], bounds[docs[1:]]
    doc_lengths = ends - starts
    n_docs, total = len(doc_lengths), int(bounds[-1])
    problems: list[str] = []
    figures = {
        "prefix": prefix,
        "documents": n_docs,
        "tokens": total,
        "dtype": np.dtype(dtype).name,
    }

    itemsize = np.dtype(dtype).itemsize
    bin_bytes = Path(prefix + ".bin").stat().st_size
    if bin_bytes != total * itemsize:
        problems.append(
            f"{prefix}.bin has {bin_bytes} bytes, the index describes {total * itemsize}"
        )
        return {**figures, "problems": problems}
    if not np.array_equal(dataset.index.sequence_pointers, bounds[:-1] * itemsize):
        bad = first(dataset.index.sequence_pointers != bounds[:-1] * itemsize)
        problems.append(f"sequence {bad}: pointer does not match the sequence lengths")

    if expected_documents is not None and n_docs != expected_documents:
        problems.append(f"{n_docs} documents, expected {expected_documents}")
    if (bad := first(doc_lengths == 0)) is not None:
        problems.append(
            f"document {bad} is empty ({int((doc_lengths == 0).sum())} empty documents)"
        )

    tokens = (
        dataset.bin_reader.read(dtype=dtype, count=total, offset=0) if total else np.zeros(0, dtype)
    )
    nonempty = doc_lengths > 0
    last_ids = np.full(n_docs, eod, dtype=np.int64)
    last_ids[nonempty] = tokens[ends[nonempty] - 1]
    if (bad := first(last_ids != eod)) is not None:
        problems.append(
            f"document {bad} does not end with EOD {eod} (last id {last_ids[bad]}; "
            f"{int((last_ids != eod).sum())} documents affected)"
        )

    eod_count, out_of_range = 0, None
    for offset in range(0, total, chunk_tokens):
        chunk = tokens[offset : offset + chunk_tokens]
        eod_count += int(np.count_nonzero(chunk == eod))
        if out_of_range is None and (int(chunk.max()) >= vocab_size or int(chunk.min()) < 0):
            position = offset + first((chunk >= vocab_size) | (chunk < 0))
            out_of_range = (position, int(tokens[position]))
    if out_of_range is not None:
        position, value = out_of_range
        doc = int(np.searchsorted(ends, position, side="right"))
        problems.append(
            f"document {doc}: id {value} at token {position} is outside [0, {vocab_size})"
        )
    figures["eod_inside_documents"] = eod_count - int(nonempty.sum())
    del tokens, dataset  # release the memory map before the next prefix
    return {**figures, "problems": problems}


def targets(args: argparse.Namespace) -> tuple[list[tuple[str, int | None, int | None]], int, int]:
    """([(prefix, expected documents, text bytes)], vocab size, eod) from manifest or flags."""
    if args.dataset_dir:
        base = Path(args.dataset_dir)
        manifest = manifest_lib.load(base / MANIFEST_FILE)
        settings = manifest["settings"]
        return (
            [
                (str(base / p["prefix"]), p["documents"], p["text_bytes"])
                for p in manifest["prefixes"]
            ],
            settings["vocab_size"],
            settings["eod_id"],
        )
    if not args.prefix or args.vocab_size is None or args.eod_id is None:
        raise StepError("give --dataset-dir, or --prefix with --vocab-size and --eod-id")
    expected = args.expected_documents if len(args.prefix) == 1 else None
    return [(p, expected, None) for p in args.prefix], args.vocab_size, args.eod_id


def gate(args: argparse.Namespace) -> dict:
    entries, vocab_size, eod = targets(args)
    results, problems = [], []
    for prefix, expected, text_bytes in entries:
        if not (Path(prefix + ".bin").exists() and Path(prefix + ".idx").exists()):
            raise StepError(f"{prefix}: .bin or .idx is missing")
        result = check_prefix(prefix, vocab_size, eod, expected, args.chunk_tokens)
        if text_bytes:
            result["text_bytes"] = text_bytes
            result["tokens_per_byte"] = round(result["tokens"] / text_bytes, 6)
        results.append(result)
        problems += [f"{prefix}: {p}" for p in result["problems"]]
        log(
            f"{prefix}: {result['documents']} documents, {result['tokens']} tokens, "
            f"{'OK' if not result['problems'] else '; '.join(result['problems'])}"
        )
    total = {
        "documents": sum(r["documents"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
    }
    if all("text_bytes" in r for r in results):
        total["text_bytes"] = sum(r["text_bytes"] for r in results)
        total["tokens_per_byte"] = round(total["tokens"] / max(1, total["text_bytes"]), 6)
    expected_total = args.expected_documents if len(entries) > 1 else None
    if args.ingest_result:
        expected_total = read_json(args.ingest_result)["docs_out"]
    if expected_total is not None and total["documents"] != expected_total:
        problems.append(f"{total['documents']} documents in all, ingest recorded {expected_total}")
    payload = {"prefixes": results, "total": total, "vocab_size": vocab_size, "eod_id": eod}
    if problems:
        raise StepError("token gate failed: " + "; ".join(problems), payload)
    return payload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.token_gate", description=__doc__)
    p.add_argument("--dataset-dir", help="directory with manifest.json (checks its prefixes)")
    p.add_argument("--prefix", action="append", help="a prefix to check (without .bin/.idx)")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--eod-id", type=int)
    p.add_argument("--expected-documents", type=int, help="document count to require (total)")
    p.add_argument("--ingest-result", help="ingest's result JSON: its docs_out must match")
    p.add_argument("--output-dir", help="where the result JSON goes (default: dataset dir)")
    p.add_argument("--chunk-tokens", type=int, default=1 << 24, help="tokens scanned at a time")
    return p


def result_dir(args: argparse.Namespace) -> str:
    if args.output_dir or args.dataset_dir:
        return args.output_dir or args.dataset_dir
    return str(Path(args.prefix[0]).parent) if args.prefix else "."


main = entry_point("token_gate", parser, gate, "token_gate.json", result_dir)


if __name__ == "__main__":
    raise SystemExit(main())
