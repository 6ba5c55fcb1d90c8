"""JSONL/Parquet shards -> Megatron ``{prefix}_text_document.bin/.idx``, plus manifest.json.

    python -m jobscripts.tokenize_megatron --input DIR|GLOB|FILE --tokenizer TOKDIR
        --output-dir OUT [--workers N] [--merge NAME] [--encoder auto|tiktoken|hf|reference]
        [--legacy-tokenizer] [--json-key text] [--verify-docs 256] [--verify-chars 200000]
        [--batch-bytes 262144] [--hash-bin] [--result PATH]
        [--array-tasks N [--array-task I] | --merge-tasks N]

Output is byte-identical to Megatron-LM core_v0.16.1 ``tools/preprocess_data.py
--tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKDIR --append-eod`` run
on each shard (see jobscripts.megatron_tokenizer for what that tool does), and is
written through megatron-core's ``IndexedDatasetBuilder``. One prefix per input
shard, ``OUT/<shard stem>_text_document``; ``--merge NAME`` also concatenates
them into ``OUT/NAME_text_document`` with ``builder.add_index``.

Speed: documents stream from the shards in order on the main thread, batches of
about ``--batch-bytes`` are encoded on ``--workers`` threads (tiktoken and HF
tokenizers release the GIL; each thread has its own tiktoken Encoding, see
jobscripts.fast_encoder), and the main thread writes them in order. Memory
holds a few batches, whatever the corpus size. The encoder is tiktoken rebuilt
from the tokenizer's vocabulary and merges; it starts at once while a forked
process builds Megatron's own tokenizer and compares ids on a sample plus probes
(jobscripts.encoder_check). That sample is the first documents the job reads (its first
batch): drawing one from every shard decoded a whole Parquet row group of each, 0.43 of
the check's 0.84 CPU-s on the benchmark corpus, while the encoding wanted both cores.
No shard is marked done before that verdict; a negative one redoes the shards with the
next encoder that matches (HF tokenizers, else Megatron's tokenizer itself).

Resumable: a finished shard leaves ``<prefix>.done.json``; a rerun skips shards
whose marker matches the input file, tokenizer and outputs. ``manifest.json`` is
deleted at start and written last, so its presence means the dataset is complete.

Over nodes (a Slurm job array, operators/campaign/render/stages.py): ``--array-tasks N``
makes this one of N tasks, task I (``--array-task``, default ``$SLURM_ARRAY_TASK_ID``)
tokenizing the I-th contiguous group of the sorted shards, writing neither the merged
prefix nor the manifest, and its result as ``result_I.json`` (naming its shards from the
start). A finished task leaves ``.array_tasks/task_I_of_N.done.json``; a rerun of the task
whose record and shards still match does nothing. ``--merge-tasks N`` is the merge job after
the array: it requires every task's record (else fails naming each missing task and its
shards), then merges and writes the manifest, so the output is the single job's, byte for byte.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, islice
from pathlib import Path

import numpy as np

from jobscripts import manifest as manifest_lib
from jobscripts.array_task import (
    add_array_arguments,
    resolve_array_args,
)
from jobscripts.common import StepError, log, run_step
from jobscripts.doc_encoder import Encoder, choose, encode_batch
from jobscripts.doc_stream import (
    describe_location,
    iter_documents,
    list_inputs,
    shard_stem,
    use_system_allocator,
)
from jobscripts.encoder_check import BackgroundCheck, Guess, GuessRejected
from jobscripts.fast_encoder import TiktokenEncoder, Unsupported, spec_and_facts
from jobscripts.job_files import MANIFEST_FILE
from jobscripts.megatron_tokenizer import load, output_dtype, sha256_file
from jobscripts.results import write_json_atomic
from jobscripts.shard_output import (
    ShardWriter,
    finished,
    mark_done,
    mark_task_done,
    merge,
    shard_identity,
    task_finished,
    task_shards,
)

PROGRESS_EVERY_S = 10.0


def batches(path: Path, key: str, batch_bytes: int):
    """Lists of (text, position) of about ``batch_bytes`` characters each, streamed."""
    batch, size = [], 0
    for text, position in iter_documents(path, key):
        batch.append((text, position))
        size += _chars(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _chars(text) -> int:
    return len(text) if isinstance(text, str) else sum(map(len, text))


def first_documents(texts, docs: int, chars: int) -> list:
    """The first of ``texts``, at most ``docs`` of them (at least one) and stopping once
    ``chars`` characters are in: Megatron's tokenizer, which checks them, is slow."""
    sample: list = []
    total = 0
    for text in islice(texts, max(1, docs)):
        sample.append(text)
        total += _chars(text)
        if total >= chars:
            break
    return sample


def verification_sample(paths: list[Path], args: argparse.Namespace) -> list:
    """The first documents of each shard, within the budget shared among them."""
    sample: list = []
    for path in paths:
        docs = iter_documents(path, args.json_key, batch_rows=16)  # a few rows, not a batch
        sample += first_documents((text for text, _pos in docs),
                                  args.verify_docs // len(paths), args.verify_chars // len(paths))
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


def work_items(todo, args):
    """(shard index, batch), in input order, across shard boundaries."""
    for index, (path, _prefix, _identity) in enumerate(todo):
        for batch in batches(path, args.json_key, args.batch_bytes):
            yield index, batch


def tokenize_shards(todo, encoder, eod, facts, args, progress, guess=None,
                    items=None) -> list[dict]:
    """Encode the pending shards on a thread pool; write each through its own builder.

    A finished shard is marked done at once, or, when tokenization runs on a ``guess``,
    as soon as the guess is confirmed (never blocking before the last shard). ``items``:
    :func:`work_items` of ``todo`` when the caller has already started it.
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

    records: list[dict] = []
    writer, current = None, None
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        pending: deque = deque()
        stream = iter(items if items is not None else work_items(todo, args))

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


def fast_start(todo, tokenizer_dir: Path, args, progress) -> tuple | None:
    """Tokenize with tiktoken at once while a forked child checks it; None if it is rejected.

    Order matters on few cores: the check forks first and builds Megatron's tokenizer while
    this process reads the first batch (the check's sample) and builds its encoder.
    """
    if args.legacy_tokenizer or args.encoder not in ("auto", "tiktoken"):
        return None  # the legacy BOS wrapping needs Megatron's tokenizer up front
    check = BackgroundCheck(tokenizer_dir, args.encoder, False)
    items = work_items(todo, args)
    first = next(items, None)
    if first is not None:
        check.send_sample(first_documents([text for text, _pos in first[1]], args.verify_docs,
                                          args.verify_chars))
    try:
        spec, vocab_size, eod = spec_and_facts(tokenizer_dir)
    except Unsupported:
        spec = eod = None
    if first is None or spec is None or eod is None:
        check.cancel()  # nothing to read, or no tiktoken: the sure path says why
        return None
    encoder = Encoder("tiktoken", TiktokenEncoder(spec).encode)
    check.send_spec(spec)
    guess = Guess(check, ("tiktoken", vocab_size, eod))
    facts = facts_of(vocab_size, eod, "tiktoken")
    try:
        records = tokenize_shards(todo, encoder, eod, facts, args, progress, guess,
                                  items=chain([first], items))
    except GuessRejected as exc:
        log(f"encoder check: Megatron disagrees ({exc.args[0]}); tokenizing again")
        return None
    return facts, guess.check.result()["report"], records, progress


def checked_start(todo, tokenizer_dir: Path, args) -> tuple:
    """Build Megatron's tokenizer first, pick the encoder, then tokenize (the slow, sure way)."""
    sample = verification_sample([path for path, _prefix, _identity in todo], args)
    reference = load(tokenizer_dir, legacy=args.legacy_tokenizer)
    if reference.eod is None:
        raise StepError(f"{tokenizer_dir}: the tokenizer has no eos_token, so no EOD to append")
    encoder, report = choose(tokenizer_dir, reference, sample, args.encoder, args.legacy_tokenizer)
    facts = facts_of(reference.vocab_size, reference.eod, encoder.name)
    progress = Progress()
    records = tokenize_shards(todo, encoder, reference.eod, facts, args, progress)
    return facts, report, records, progress


def import_megatron() -> None:
    """Everything the job imports, once, before the encoder check forks."""
    import_start = time.monotonic()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (~20 s: torch and most of mcore)
    import megatron.core.tokenizers  # noqa: F401

    # Megatron's HF tokenizer library, and with it transformers (~2.5 CPU-s: v5 scans every
    # model's files at import), is what the encoder check builds. Imported here, the forked
    # check inherits it: it no longer spends those seconds importing on the cores the
    # encoding threads need (measured: most of the check's CPU time), nor holds a private
    # copy (forked pages are shared).
    import megatron.core.tokenizers.text.libraries.huggingface_tokenizer  # noqa: F401

    log(f"megatron-core imported in {time.monotonic() - import_start:.1f} s")
    # builder.add_index calls gc.collect() per shard: 0.3 s each over the millions of objects
    # the imports made. Frozen objects are skipped by collections.
    gc.freeze()


def plan(args: argparse.Namespace) -> tuple[Path, list, dict]:
    """(output dir, [(shard, prefix, identity)] for every input shard in order, settings)."""
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # stale manifests must not outlive a failed run
    shards = list_inputs(args.input)
    if not shards:
        raise StepError(f"no .jsonl/.jsonl.gz/.parquet input matches {args.input}")
    stems = [shard_stem(p) for p in shards]
    if len(set(stems)) != len(stems):
        raise StepError(f"input shards share a file name stem, outputs would collide: {stems}")
    # What a shard's output depends on; the vocabulary size, EOD and dtype follow from these.
    settings = {"tokenizer_sha256": sha256_file(Path(args.tokenizer) / "tokenizer.json"),
                "legacy_tokenizer": args.legacy_tokenizer, "json_key": args.json_key,
                "append_eod": True}  # fmt: skip
    entries = [(path, out / f"{stem}_text_document", shard_identity(path, settings))
               for path, stem in zip(shards, stems, strict=True)]
    return out, entries, settings


def encode_pending(entries: list, args: argparse.Namespace) -> tuple[list, list, dict, Progress]:
    """Tokenize the shards of ``entries`` not finished yet: (done records, the shards that were
    tokenized, the encoder report, progress)."""
    done, todo = [], []
    for path, prefix, identity in entries:
        if record := finished(prefix, identity):
            log(f"skipping {path}: {prefix} is complete")
            done.append(record)
        else:
            todo.append((path, prefix, identity))
    progress, report = Progress(), {}
    if todo:
        import_megatron()
        use_system_allocator()
        fast = fast_start(todo, Path(args.tokenizer), args, progress)
        _facts, report, records, progress = fast or checked_start(
            todo, Path(args.tokenizer), args)
        done += records
    return done, todo, report, progress


def run_array_task(args: argparse.Namespace) -> dict:
    """One array task: its group of shards, tokenized (or already done), no merge, no
    manifest: the merge job writes it once every task is done."""
    out, entries, _settings = plan(args)
    task, tasks = args.array_task, args.array_tasks
    owned = task_shards(entries, task, tasks)
    names = [path.name for path, _p, _i in owned]
    where = {"array_task": task, "array_tasks": tasks, "shards": names}
    if args.result:  # a task killed before its end still names its shards
        write_json_atomic(args.result, {**where, "ok": False, "step": "tokenize_megatron",
                                        "error": f"array task {task} started, did not finish"})
    if task_finished(out, task, tasks, [(p, i) for _s, p, i in owned]):
        log(f"array task {task} of {tasks}: done by an earlier run ({len(owned)} shards)")
        return {**where, "skipped_shards": len(owned), "tokenized_shards": 0, "tokens": 0,
                "task_done_before": True}
    log(f"array task {task} of {tasks}: shards {names}")
    try:
        done, todo, report, progress = encode_pending(owned, args)
    except StepError as exc:
        raise StepError(f"array task {task} (shards {', '.join(names)}): {exc}", where) from exc
    except Exception as exc:
        raise StepError(f"array task {task} (shards {', '.join(names)}): "
                        f"{type(exc).__name__}: {exc}", where) from exc
    done = sorted(done, key=lambda r: r["prefix"])
    mark_task_done(out, task, tasks, done)
    elapsed = time.monotonic() - progress.start
    return {**where, "skipped_shards": len(owned) - len(todo), "tokenized_shards": len(todo),
            "documents": sum(r["documents"] for r in done),
            "tokens": sum(r["tokens"] for r in done), "encoder": report,
            "task_done_before": False,
            "tokens_per_s_this_run": round(progress.tokens / elapsed, 1) if progress.tokens
            else None}


def finished_tasks(out: Path, entries: list, tasks: int) -> list[dict]:
    """Every shard's done record, from the array tasks' records; StepError naming each task
    that did not finish and its shards."""
    records, missing = [], []
    for task in range(tasks):
        owned = task_shards(entries, task, tasks)
        if task_finished(out, task, tasks, [(p, i) for _s, p, i in owned]) is None:
            missing.append(f"task {task} (shards {', '.join(s.name for s, _p, _i in owned)})")
            continue
        records += [finished(prefix, identity) for _s, prefix, identity in owned]
    if missing:
        raise StepError(f"{len(missing)} of {tasks} array tasks did not finish: "
                        + "; ".join(missing), {"unfinished_tasks": missing})
    return records


def run(args: argparse.Namespace) -> dict:
    if args.array_tasks:
        return run_array_task(args)
    out, entries, settings = plan(args)
    if args.merge_tasks:  # the merge job after an array: every task must have finished
        done, todo, report, progress = finished_tasks(out, entries, args.merge_tasks), [], {}, \
            Progress()
        import_megatron()
    else:
        done, todo, report, progress = encode_pending(entries, args)
    facts = {k: done[0][k] for k in ("vocab_size", "eod_id", "dtype")}
    settings.update(facts)
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
        "skipped_shards": len(entries) - len(todo),
        "tokenized_shards": len(todo),
        "array_tasks": args.merge_tasks or None,
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
    # 256 KiB: the last batches of the run keep both workers busy (1 MiB left one idle for
    # its last batch: 0.82 -> 0.86 of the raw encoder's rate on the benchmark corpus).
    p.add_argument("--batch-bytes", type=int, default=1 << 18, help="text per encoding batch")
    p.add_argument("--hash-bin", action="store_true", help="also record sha256 of each .bin")
    add_array_arguments(p, "run as one of N array tasks: tokenize this task's group of shards "
                           "only (no merge, no manifest)",
                        "the merge after N array tasks: require each task's done record, "
                        "then merge and write the manifest")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    p.add_argument("--result", help="where to write the result JSON (default: "
                   "<output dir>/tokenize.json; an array task adds _<task> to its name)")
    args = p.parse_args(argv)
    default = Path(args.output_dir) / "tokenize.json"
    resolve_array_args(p, args, default)
    return run_step("tokenize_megatron", args, default, run)


if __name__ == "__main__":
    raise SystemExit(main())
