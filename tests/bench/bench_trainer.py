"""Benchmark: CPU reference trainer throughput and checkpoint save/load time (issue 4 §7).

    python -m tests.bench.bench_trainer      (from the repository root; not collected by pytest)

Prints one JSON line:
``{"bench": "reference_trainer", "tokens_per_s": X, "save_s": X, "load_s": X}``.

The model is the trainer's default tiny Llama (2 layers, hidden 64, seq 64) with a 32 K
vocabulary, as with the BPE tokenizer the data stage trains (~4.3 M parameters, most of them
embeddings). Throughput counts training steps only (no validation, no saving); ``save_s`` is
the mean of the segment's saves (weights + AdamW state + RNG, fsynced, renamed, tracker
updated); ``load_s`` is the next segment's resume (weights, optimizer, RNG). The trainer's
log is kept in memory and shown (its tail, on stderr) only when a run fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from tests.trainer.synthetic_data import base_config, write_dataset

VOCAB = 32768
ITERATIONS = 40
SAVES = 4


def run_segment(directory: Path, config: dict, *flags: str) -> dict:
    from jobscripts.reference_trainer import main

    (directory / "run.json").write_text(json.dumps(config))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        code = main(["--config", str(directory / "run.json"), *flags])
    if code != 0:
        sys.stderr.write(log.getvalue()[-4000:])
        raise SystemExit(f"reference trainer failed with exit code {code}")
    return json.loads(Path(config["segment_result"]).read_text())


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="pp-bench-trainer-") as tmp:
        root = Path(tmp)
        prefix = write_dataset(root / "bench_text_document", documents=2000, vocab_size=VOCAB)
        config = base_config(
            prefix, root / "ckpt", vocab_size=VOCAB, seq_length=64, train_iters=ITERATIONS + 1,
            eval_interval=None, save_interval=ITERATIONS // SAVES, log_interval=10,
        )
        trained = run_segment(root, config, "--exit-interval", str(ITERATIONS))
        resumed = run_segment(root, config)  # loads iteration 40, trains 1, saves
    return {
        "bench": "reference_trainer",
        "tokens_per_s": round(trained["tokens_consumed"] / trained["train_seconds"], 1),
        "save_s": round(trained["save_seconds"] / trained["saves"], 4),
        "load_s": round(resumed["load_seconds"], 4),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
