"""JSONL/Parquet shards -> Megatron ``{prefix}_text_document.bin/.idx``, plus manifest.json.

    python -m jobscripts.tokenize_megatron --input DIR|GLOB|FILE --tokenizer TOKDIR
        --output-dir OUT [--workers N] [--merge NAME] [--encoder auto|tiktoken|hf|reference]
        [--legacy-tokenizer] [--json-key text] [--verify-docs 256] [--verify-chars 200000]
        [--batch-bytes 1048576] [--hash-bin] [--result PATH]

Output is byte-identical to Megatron-LM core_v0.16.1 ``tools/preprocess_data.py
--tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKDIR --append-eod`` run
on each shard (see jobscripts.megatron_tokenizer for what that tool does), and is
written through megatron-core's ``IndexedDatasetBuilder``. One prefix per input
shard, ``OUT/<shard stem>_text_document``; ``--merge NAME`` also concatenates
them into ``OUT/NAME_text_document`` with ``builder.add_index``.

Speed: documents stream from the shards in order on the main thread, batches of
about ``--batch-bytes`` are encoded on ``--workers`` threads (tiktoken and HF
tokenizers release the GIL), and the main thread writes them in order. Memory
holds a few batches, whatever the corpus size. The encoder is tiktoken rebuilt
from the tokenizer's vocabulary and merges; it starts at once while a forked
process builds Megatron's own tokenizer and compares ids on a sample plus probes
(jobscripts.encoder_check). No shard is marked done before that verdict; a
negative one redoes the shards with the next encoder that matches (HF tokenizers,
else Megatron's tokenizer itself).

Resumable: a finished shard leaves ``<prefix>.done.json``; a rerun skips shards
whose marker matches the input file, tokenizer and outputs. ``manifest.json`` is
deleted at start and written last, so its presence means the dataset is complete.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

import numpy as np

from jobscripts import manifest as manifest_lib
from jobscripts.common import StepError, entry_point, log
from jobscripts.doc_encoder import Encoder, choose, encode_batch
from jobscripts.doc_stream import describe_location, iter_documents, list_inputs, shard_stem
from jobscripts.encoder_check import BackgroundCheck, Guess, GuessRejected, files_view
from jobscripts.fast_encoder import TiktokenEncoder, Unsupported, tiktoken_spec
from jobscripts.job_files import MANIFEST_FILE
from jobscripts.megatron_tokenizer import load, output_dtype, sha256_file
from jobscripts.shard_output import ShardWriter, finished, mark_done, merge, shard_identity

PROGRESS_EVERY_S = 10.0


def batches(path: Path, key: str, batch_bytes: int):
    """Lists of (text, position) of about ``batch_bytes`` characters each, streamed."""
    batch, size = [], 0
    for text, position in iter_documents(path, key):
        batch.append((text, position))
        size += len(text) if isinstance(text, str) else sum(map(len, text))
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def verification_sample(paths: list[Path], args: argparse.Namespace) -> list:
    """The first documents of each shard, within a budget: Megatron's tokenizer is slow."""
    sample: list = []
    for path in paths:
        chars = 0
        docs = iter_documents(path, args.json_key, batch_rows=16)  # a few rows, not a batch
        docs = islice(docs, max(1, args.verify_docs // len(paths)))
        for text, _pos in docs:
            sample.append(text)
            chars += len(text) if isinstance(text, str) else sum(map(len, text))
            if chars >= args.verify_chars // len(paths):
                break
    return sample


class Progress:
    def __init__(self):
        self.start = self.last = time.monotonic()
        self.docs = self.tokens = self.bytes = 0

    def add(self, docs: int, tokens: int, text_bytes: int, where: str) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += text_bytes
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            elapsed = now - self.start
            log(
                f"{self.docs} documents, {self.tokens} tokens ({self.tokens / elapsed / 1e6:.2f} M "
                f"tokens/s, {self.bytes / elapsed / 1e6:.1f} MB/s of text), in {where}"
            )


def tokenize_shards(todo, encoder, eod, facts, args, progress, guess=None) -> list[dict]:
    """Encode the pending shards on a thread pool; write each through its own builder.

    A finished shard is marked done at once, or, when tokenization runs on a ``guess``,
    as soon as the guess is confirmed (never blocking before the last shard).
    """
    dtype = np.dtype(facts["dtype"]).type
    out = todo[0][1].parent
    unmarked: list[dict] = []

    def mark(wait: bool) -> None:
        if unmarked and (guess is None or wait or guess.ready()):
            if guess is not None:
                guess.confirm()  # raises GuessRejected: nothing of this run gets marked
            for record in unmarked:
                mark_done(record, out)
            unmarked.clear()

    def work():  # (shard index, batch), in input order, across shard boundaries
        for index, (path, _prefix, _identity) in enumerate(todo):
            for batch in batches(path, args.json_key, args.batch_bytes):
                yield index, batch

    records: list[dict] = []
    writer, current = None, None
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        pending: deque = deque()
        stream = iter(work())

        def submit(item):
            index, batch = item
            texts = [text for text, _pos in batch]
            future = pool.submit(encode_batch, encoder, texts, eod, dtype)
            pending.append((index, batch, texts, future))

        for item in islice(stream, 2 * args.workers):
            submit(item)
        while pending:
            index, batch, texts, future = pending.popleft()
            if (item := next(stream, None)) is not None:
                submit(item)  # keep the pool fed while this batch is written
            path, prefix, identity = todo[index]
            if index != current:
                if writer is not None:
                    records.append(writer.close(args.hash_bin))
                    unmarked.append(records[-1])
                writer, current = ShardWriter(prefix, identity, dtype, facts), index
                log(f"tokenizing {path} -> {prefix}")
            try:
                counts, tokens, splits, text_bytes = future.result()
            except (ValueError, UnicodeEncodeError, TypeError) as exc:
                where = describe_location(path, batch[0][1])
                raise StepError(f"{where} (batch starting here): cannot encode: {exc}") from exc
            written = writer.add(counts, tokens, splits, text_bytes)
            progress.add(len(texts), written, text_bytes, path.name)
            mark(wait=False)
        if writer is not None:
            records.append(writer.close(args.hash_bin))
            unmarked.append(records[-1])
        mark(wait=True)
    return records


def facts_of(vocab_size: int, eod: int, encoder: str) -> dict:
    return {"vocab_size": vocab_size, "eod_id": eod, "dtype": output_dtype(vocab_size).__name__,
            "encoder": encoder}  # fmt: skip


def fast_start(todo, tokenizer_dir: Path, sample: list, args, progress) -> tuple | None:
    """Tokenize with tiktoken at once while a forked child checks it; None if it is rejected."""
    if args.legacy_tokenizer or args.encoder not in ("auto", "tiktoken"):
        return None  # the legacy BOS wrapping needs Megatron's tokenizer up front
    try:
        encoder = Encoder(
            "tiktoken", TiktokenEncoder(tiktoken_spec(tokenizer_dir / "tokenizer.json")).encode
        )
    except Unsupported:
        return None
    vocab_size, eod = files_view(tokenizer_dir)
    if eod is None:
        return None  # let the Megatron path report it
    prebuilt = {"tiktoken": encoder.encode}  # the child checks this very encoder
    check = BackgroundCheck(tokenizer_dir, sample, args.encoder, False, prebuilt)
    guess = Guess(check, ("tiktoken", vocab_size, eod))
    facts = facts_of(vocab_size, eod, "tiktoken")
    try:
        records = tokenize_shards(todo, encoder, eod, facts, args, progress, guess)
    except GuessRejected as exc:
        log(f"encoder check: Megatron disagrees ({exc.args[0]}); tokenizing again")
        return None
    return facts, guess.check.result()["report"], records, progress


def checked_start(todo, tokenizer_dir: Path, sample: list, args) -> tuple:
    """Build Megatron's tokenizer first, pick the encoder, then tokenize (the slow, sure way)."""
    reference = load(tokenizer_dir, legacy=args.legacy_tokenizer)
    if reference.eod is None:
        raise StepError(f"{tokenizer_dir}: the tokenizer has no eos_token, so no EOD to append")
    encoder, report = choose(tokenizer_dir, reference, sample, args.encoder, args.legacy_tokenizer)
    facts = facts_of(reference.vocab_size, reference.eod, encoder.name)
    progress = Progress()
    records = tokenize_shards(todo, encoder, reference.eod, facts, args, progress)
    return facts, report, records, progress


def run(args: argparse.Namespace) -> dict:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # stale manifests must not outlive a failed run
    shards = list_inputs(args.input)
    if not shards:
        raise StepError(f"no .jsonl/.jsonl.gz/.parquet input matches {args.input}")
    stems = [shard_stem(p) for p in shards]
    if len(set(stems)) != len(stems):
        raise StepError(f"input shards share a file name stem, outputs would collide: {stems}")
    tokenizer_dir = Path(args.tokenizer)
    import_start = time.monotonic()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (~20 s: torch and most of mcore)
    import megatron.core.tokenizers  # noqa: F401

    log(f"megatron-core imported in {time.monotonic() - import_start:.1f} s")
    # builder.add_index calls gc.collect() per shard: 0.3 s each over the millions of objects
    # the imports made. Frozen objects are skipped by collections.
    gc.freeze()
    # What a shard's output depends on; the vocabulary size, EOD and dtype follow from these.
    settings = {"tokenizer_sha256": sha256_file(tokenizer_dir / "tokenizer.json"),
                "legacy_tokenizer": args.legacy_tokenizer, "json_key": args.json_key,
                "append_eod": True}  # fmt: skip
    done, todo = [], []
    for path, stem in zip(shards, stems, strict=True):
        prefix, identity = out / f"{stem}_text_document", shard_identity(path, settings)
        if record := finished(prefix, identity):
            log(f"skipping {path}: {prefix} is complete")
            done.append(record)
        else:
            todo.append((path, prefix, identity))
    progress, report = Progress(), {}
    if todo:
        sample = verification_sample([p for p, _x, _i in todo], args)
        fast = fast_start(todo, tokenizer_dir, sample, args, progress)
        facts, report, records, progress = fast or checked_start(todo, tokenizer_dir, sample, args)
        done += records
    else:
        facts = {k: done[0][k] for k in ("vocab_size", "eod_id", "dtype")}
    settings.update({k: facts[k] for k in ("vocab_size", "eod_id", "dtype")})
    records = sorted(done, key=lambda r: r["prefix"])
    shard_records = records
    if args.merge:
        dtype = np.dtype(settings["dtype"]).type
        records = [merge(records, out, args.merge, dtype, settings, args.hash_bin)]
    manifest = manifest_lib.build(records, settings, shards=shard_records if args.merge else None)
    manifest_lib.write(out / MANIFEST_FILE, manifest)  # last: it certifies everything above
    elapsed = time.monotonic() - progress.start
    log(f"done: {manifest['total']['documents']} documents, {manifest['total']['tokens']} tokens")
    return {
        "output_dir": str(out),
        "manifest": str(out / MANIFEST_FILE),
        "manifest_fingerprint": manifest["fingerprint"],
        "prefixes": [str(out / r["prefix"]) for r in records],
        "skipped_shards": len(shards) - len(todo),
        "tokenized_shards": len(todo),
        "documents": manifest["total"]["documents"],
        "tokens": manifest["total"]["tokens"],
        "vocab_size": settings["vocab_size"],
        "eod_id": settings["eod_id"],
        "dtype": settings["dtype"],
        "encoder": report,
        "tokens_per_s_this_run": round(progress.tokens / elapsed, 1) if progress.tokens else None,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.tokenize_megatron", description=__doc__)
    p.add_argument("--input", required=True, help="shard file, directory or glob (JSONL/Parquet)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json)")
    p.add_argument("--output-dir", required=True)
    p.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="encoding threads (default: CPUs this job may use)",
    )
    p.add_argument("--merge", metavar="NAME", help="also write OUT/NAME_text_document")
    p.add_argument("--encoder", choices=["auto", "tiktoken", "hf", "reference"], default="auto")
    p.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="mirror preprocess_data --legacy-tokenizer (post-processor BOS/EOS)",
    )
    p.add_argument("--json-key", default="text")
    p.add_argument(
        "--verify-docs", type=int, default=256, help="documents checked against Megatron"
    )
    p.add_argument("--verify-chars", type=int, default=200_000, help="and at most this much text")
    p.add_argument("--batch-bytes", type=int, default=1 << 20, help="text per encoding batch")
    p.add_argument("--hash-bin", action="store_true", help="also record sha256 of each .bin")
    return p


main = entry_point("tokenize_megatron", parser, run, "tokenize.json")


if __name__ == "__main__":
    raise SystemExit(main())
