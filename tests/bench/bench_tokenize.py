"""Benchmark: end-to-end Megatron tokenization vs preprocess_data and the raw limit (issue 3 §9).

    python tests/bench/bench_tokenize.py          (or python -m tests.bench.bench_tokenize)

Corpus: /work/shared/corpus/*.parquet with /work/shared/tokenizers/gpt2 when they exist,
else a demo corpus built here and a BPE trained on it. Three phases, each in its own
process (so each one's memory is its own), timed inside that process after its imports:

- ours: ``jobscripts.tokenize_megatron`` from the Parquet shards to one merged
  ``.bin/.idx`` (read Parquet, verify the encoder, encode, write, manifest);
- baseline: a mirror of Megatron-LM's ``preprocess_data.py --workers 2 --append-eod``:
  ``Pool(2).imap(encode, lines, 32)`` over the same documents as JSONL, one document per
  task with Megatron's HF tokenizer, one IndexedDatasetBuilder in the main process;
- raw limit: the fastest encoder shown to give identical ids (tiktoken built from the same
  vocabulary and merges), 2 threads, over the documents already in memory, writing nothing.
  The best of two ways counts: tiktoken's own ``encode_batch`` (its threads share one
  Encoding) and a thread pool where each thread encodes with its own Encoding, as the job
  does (``fast_encoder.TiktokenEncoder``: sharing one costs ~20% of the CPU in tiktoken
  0.14).

This machine is shared: ours and the raw limit run three times, alternating, and the best run
of each counts; the baseline (ten times slower) runs once. The load average is in the details.
Other tenants of this VM's host move the CPU time a fixed amount of work takes by up to 15%
between minutes (the same job: 6.3 CPU-s in one bench run, 7.1 in the next), and a job that
streams from disk more than the raw limit, which encodes texts already in memory: with two
runs each, the ratio moved 0.83-0.92 on the same code within ten minutes.

Peak memory is sampled from /proc (smaps_rollup) over the whole process tree (GNU time misses
forkserver children), in a third run of ours that is not timed: reading smaps_rollup of a
process that imported torch, and of its forked check, takes a few ms; every 50 ms that was
~10% of a core taken from the timed job (1.5 CPU-s over a 15 s run), and not from the raw
limit, whose small process is cheap to read. The baseline's one run is sampled every 500 ms
(its memory is flat over its ~35 s). ``peak_rss_mb`` is the tree's summed PSS: resident
memory with pages shared copy-on-write by forked processes counted once; the summed RSS,
which counts them in every process, is in the details. Prints one JSON line; details go to
stderr.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))

SHARED = Path("/work/shared")
WORKERS = 2
RUNS = 3  # of ours and of the raw limit, alternating; the best of each counts


def tree_pids(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants, from the parent links in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # the process ended while we looked
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def tree_memory_kb(root_pid: int) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) over the tree. PSS splits pages shared by forked processes
    (copy-on-write) among them, so its sum is the memory the tree really holds."""
    rss = pss = 0
    for pid in tree_pids(root_pid):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return rss, pss


def run_phase(phase: str, work: Path, sample_every: float | None = None) -> tuple[dict, dict]:
    """Run one phase in a child process; return its JSON report and, when ``sample_every``
    (seconds) is given, the tree's peak memory sampled that often (else zeros)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--phase", phase, str(work)],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        cwd=ROOT,
    )
    peak = {"rss_mb": 0.0, "pss_mb": 0.0}
    done = threading.Event()

    def sample():
        while not done.wait(sample_every):
            rss, pss = tree_memory_kb(proc.pid)
            peak["rss_mb"] = max(peak["rss_mb"], rss / 1024)
            peak["pss_mb"] = max(peak["pss_mb"], pss / 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    if sample_every:
        sampler.start()
    out, _ = proc.communicate()
    done.set()
    if sample_every:
        sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1]), peak


def prepare(work: Path) -> dict:
    """Corpus and tokenizer (shared ones if present, else a demo), plus the baseline's JSONL."""
    import pyarrow.parquet as pq

    corpus, tokenizer = SHARED / "corpus", SHARED / "tokenizers" / "gpt2"
    if not (corpus.is_dir() and (tokenizer / "tokenizer.json").is_file()):
        from jobscripts import demo_corpus, train_tokenizer

        corpus, tokenizer = work / "corpus", work / "tokenizer"
        demo_corpus.main(
            ["--output-dir", str(corpus), "--target-bytes", "20000000", "--shards", "4"]
        )
        train_tokenizer.main(["--input", str(corpus / "000_00000.parquet"), "--output-dir",
                              str(tokenizer), "--vocab-size", "16384", "--no-verify"])  # fmt: skip
    shards = sorted(corpus.glob("*.parquet"))
    with open(work / "train.jsonl", "w", encoding="utf-8") as handle:  # preprocess_data's input
        for shard in shards:
            for text in pq.read_table(shard, columns=["text"]).column("text").to_pylist():
                handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return {"corpus": str(corpus / "*.parquet"), "tokenizer": str(tokenizer), "shards": len(shards)}


# --- phases (child processes) -------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for (the encoder
    check, pool workers): unlike wall time, hardly changed by other load on the machine."""
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def phase_ours(work: Path, setup: dict) -> dict:
    from jobscripts.tokenize_megatron import import_megatron, main

    import_megatron()  # the job's own imports, all of them: imports are not the step

    shutil.rmtree(work / "ours", ignore_errors=True)  # a fresh run, not a resumed one
    started, cpu = time.monotonic(), cpu_seconds()
    code = main(["--input", setup["corpus"], "--tokenizer", setup["tokenizer"], "--output-dir",
                 str(work / "ours"), "--merge", "bench", "--workers", str(WORKERS)])  # fmt: skip
    seconds, cpu = time.monotonic() - started, cpu_seconds() - cpu
    result = json.loads((work / "ours" / "tokenize.json").read_text())
    if code != 0:
        raise SystemExit(result["error"])
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": result["tokens"],
            "encoder": result["encoder"]}  # fmt: skip


class Encoder:
    """preprocess_data's Encoder for one json key, no sentence splitting, --append-eod."""

    def __init__(self, tokenizer_dir: str):
        self.tokenizer_dir = tokenizer_dir

    def initializer(self):
        from jobscripts.megatron_tokenizer import load

        Encoder.tokenizer = load(self.tokenizer_dir)

    def encode(self, json_line: str):
        text = json.loads(json_line)["text"]
        ids = Encoder.tokenizer.tokenize(text)
        lengths = [len(ids)] if ids else []
        if ids:
            ids.append(Encoder.tokenizer.eod)
            lengths[-1] += 1
        return ids, lengths, len(json_line)


def phase_baseline(work: Path, setup: dict) -> dict:
    import multiprocessing

    from megatron.core.datasets import indexed_dataset

    from jobscripts.megatron_tokenizer import load

    started, cpu = time.monotonic(), cpu_seconds()
    tokenizer = load(setup["tokenizer"])
    encoder = Encoder(setup["tokenizer"])
    prefix = work / "baseline_text_document"
    tokens = 0
    with open(work / "train.jsonl", encoding="utf-8") as fin:
        pool = multiprocessing.Pool(WORKERS, initializer=encoder.initializer)
        builder = indexed_dataset.IndexedDatasetBuilder(
            f"{prefix}.bin", dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
        )
        for ids, lengths, _bytes in pool.imap(encoder.encode, fin, 32):
            builder.add_document(ids, lengths)
            tokens += len(ids)
        builder.finalize(f"{prefix}.idx")
        pool.close()
        pool.join()
    return {"seconds": time.monotonic() - started, "cpu_seconds": cpu_seconds() - cpu,
            "tokens": tokens}  # fmt: skip


def phase_raw(work: Path, setup: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    from jobscripts.fast_encoder import TiktokenEncoder, tiktoken_spec

    texts = [t for s in sorted(glob.glob(setup["corpus"]))
             for t in pq.read_table(s, columns=["text"]).column("text").to_pylist()]  # fmt: skip
    fast = TiktokenEncoder(tiktoken_spec(Path(setup["tokenizer"]) / "tokenizer.json"))
    nonempty = sum(1 for t in texts if t)  # each of these gets an EOD: count it as a token
    best, variants = 0.0, {}
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = {
            "tiktoken encode_batch": lambda: sum(map(len, fast.encoding.encode_batch(
                texts, num_threads=WORKERS, allowed_special="all"))),
            "tiktoken encode_to_numpy, one Encoding per thread": lambda: sum(
                len(a) for a in pool.map(fast.encode, texts, chunksize=8)),
        }  # fmt: skip
        for name, run in runs.items():
            started, cpu = time.monotonic(), cpu_seconds()
            tokens = run() + nonempty
            rate = tokens / (time.monotonic() - started)
            variants[name] = {"tokens_per_s": round(rate), "cpu_seconds": cpu_seconds() - cpu}
            best = max(best, rate)
    return {"tokens_per_s": best, "tokens": tokens, "variants": variants}


def child(phase: str, work: Path) -> None:
    setup = json.loads((work / "setup.json").read_text())
    report = {"ours": phase_ours, "baseline": phase_baseline, "raw": phase_raw}[phase](work, setup)
    print(json.dumps(report), flush=True)


# --- orchestration ------------------------------------------------------------------------


def same_bytes(a: Path, b: Path) -> bool:
    return all(
        Path(f"{a}{s}").read_bytes() == Path(f"{b}{s}").read_bytes() for s in (".bin", ".idx")
    )


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="pp-bench-tokenize-") as tmp:
        work = Path(tmp)
        setup = prepare(work)
        (work / "setup.json").write_text(json.dumps(setup))
        print(f"bench_tokenize: {setup}", file=sys.stderr)
        # Other work on the machine comes and goes: alternate ours and the raw limit, keep the
        # best of each (the baseline, 10x slower, runs once).
        ours_runs, raw_runs = [], []
        for _ in range(RUNS):
            ours_runs.append(run_phase("ours", work)[0])
            raw_runs.append(run_phase("raw", work)[0])
        ours = min(ours_runs, key=lambda r: r["seconds"])
        raw = max(raw_runs, key=lambda r: r["tokens_per_s"])
        memory_run, ours_rss = run_phase("ours", work, sample_every=0.05)
        baseline, baseline_rss = run_phase("baseline", work, sample_every=0.5)
        identical = same_bytes(
            work / "ours" / "bench_text_document", work / "baseline_text_document"
        )
    ours_rate = ours["tokens"] / ours["seconds"]
    base_rate = baseline["tokens"] / baseline["seconds"]
    # Tokens per CPU-second, relative: close to what an idle machine shows for the parallel
    # phases, and hardly moved by other load (wall-clock ratios are, a lot).
    raw_cpu = min(v["cpu_seconds"] for r in raw_runs for v in r["variants"].values())
    ours_cpu = min(r["cpu_seconds"] for r in ours_runs)
    cpu_ratios = {
        "ours_vs_baseline": round(baseline["cpu_seconds"] / ours_cpu, 2),
        "ours_vs_limit": round(raw_cpu / ours_cpu, 2),
    }
    details = {
        "cpu_ratios": cpu_ratios,
        "ours_runs": ours_runs,
        "ours_memory": ours_rss,
        "ours_memory_run_seconds": memory_run["seconds"],
        "raw_runs": raw_runs,
        "baseline": baseline,
        "baseline_memory": baseline_rss,
        "load_average": os.getloadavg(),
    }
    print(f"bench_tokenize details: {json.dumps(details)}", file=sys.stderr)
    return {
        "bench": "tokenize",
        "tokens": ours["tokens"],
        "tokens_per_s": round(ours_rate),
        "baseline_tokens_per_s": round(base_rate),
        "raw_limit_tokens_per_s": round(raw["tokens_per_s"]),
        "ratio_vs_baseline": round(ours_rate / base_rate, 2),
        "ratio_vs_limit": round(ours_rate / raw["tokens_per_s"], 2),
        "peak_rss_mb": round(ours_rss["pss_mb"]),
        "identical_to_baseline": identical and ours["tokens"] == baseline["tokens"],
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--phase":
        child(sys.argv[2], Path(sys.argv[3]))
    else:
        print(json.dumps(main()), flush=True)
