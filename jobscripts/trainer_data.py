"""Training data for the reference trainer: the same ``.bin/.idx`` and the same megatron-core
``GPTDataset``/``BlendedMegatronDatasetBuilder`` as the production path, on CPU.

Batches are addressed by sample index (``consumed_samples``), not drawn from an iterator, so a
resumed segment continues exactly where the last one stopped: the position is one integer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from jobscripts.trainer_config import TrainerConfig


@dataclass
class DatasetTokenizer:
    """The four attributes megatron-core's GPT datasets read from a tokenizer."""

    vocab_size: int
    eod: int
    pad: int = -1  # never a real id: padded positions get masked, real ones never are

    @property
    def unique_identifiers(self) -> dict[str, object]:
        # Part of the index-cache hash: a different vocabulary must not reuse the cache.
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}


def load_tokenizer(config: TrainerConfig) -> DatasetTokenizer:
    if config.tokenizer_model is None:
        return DatasetTokenizer(vocab_size=config.vocab_size, eod=config.eod_id)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_model)
    eod = tokenizer.eos_token_id  # Megatron's HuggingFaceTokenizer.eod is the EOS id
    if eod is None:
        raise ValueError(f"{config.tokenizer_model}: the tokenizer defines no EOS/EOD token")
    return DatasetTokenizer(vocab_size=len(tokenizer), eod=eod)


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: ``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]``."""
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        return list(data_path), None
    prefixes = list(data_path[1::2])
    if len(weights) != len(prefixes) or any(w <= 0 for w in weights):
        raise ValueError(f"data_path: expected positive weight/prefix pairs: {data_path}")
    return prefixes, weights


@contextlib.contextmanager
def _single_process_group():
    """megatron-core's BlendedDataset asks torch.distributed for its rank even in one process;
    a world of one, on an in-memory store, answers without touching the network."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_datasets(config: TrainerConfig, tokenizer: DatasetTokenizer):
    """(train, valid or None): train sized train_iters x global batch, as Megatron does."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = parse_blend(config.data_path)
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise FileNotFoundError(f"data_path: {prefix}{suffix} does not exist")
    cache = config.data_cache_path or str(Path(config.save) / "data_cache")
    dataset_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=(prefixes, weights),
        split=config.split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # HF Llama builds its own causal mask
    )
    validating = bool(config.eval_interval)
    # Sizes, not None: megatron-core refuses None for a weighted blend. The test split is
    # never read here.
    sizes = [
        config.train_iters * config.global_batch_size,
        config.eval_iters * config.global_batch_size if validating else 0,
        0,
    ]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, dataset_config)
    with _single_process_group():
        train, valid, _ = builder.build()
    if train is None:
        raise ValueError(f"split {config.split!r} leaves no training documents")
    if validating and valid is None:
        raise ValueError(f"eval_interval is set but split {config.split!r} has no valid part")
    return train, valid


def get_batch(dataset, first_sample: int, size: int) -> dict[str, torch.Tensor]:
    """Samples [first_sample, first_sample + size) stacked into one micro-batch."""
    samples = [dataset[i] for i in range(first_sample, first_sample + size)]
    keys = ("tokens", "labels", "loss_mask")
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}
