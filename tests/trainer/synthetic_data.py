"""Tiny synthetic Megatron datasets for the trainer tests and the benchmark.

Documents follow a fixed sparse bigram chain (each token has two possible successors) ending
in EOD, written with megatron-core's IndexedDatasetBuilder: random enough to need many
samples, structured enough that the loss visibly falls within a few dozen iterations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
EOD_ID = 0


def write_dataset(
    prefix: Path, documents: int = 300, seed: int = 0, vocab_size: int = VOCAB_SIZE
) -> Path:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    successors = rng.integers(1, vocab_size, size=(vocab_size, 2))
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        length = int(rng.integers(16, 160))
        ids = [int(rng.integers(1, vocab_size))]
        for choice in rng.integers(0, 2, size=length - 1):
            ids.append(int(successors[ids[-1], choice]))
        ids.append(EOD_ID)
        builder.add_document(np.array(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def base_config(prefix: Path, save: Path, **overrides) -> dict:
    """The tests' run config: ~130 K parameters, 12 iterations of 8 x 32 tokens."""
    config = {
        "data_path": [str(prefix)],
        "split": "90,10,0",
        "vocab_size": VOCAB_SIZE,
        "eod_id": EOD_ID,
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "train_iters": 12,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "lr_warmup_iters": 2,
        "eval_interval": 4,
        "eval_iters": 1,
        "save": str(save),
        "segment_result": str(save.parent / "segment.json"),
    }
    config.update(overrides)
    return config
