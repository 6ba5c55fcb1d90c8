"""Model, optimizer, learning-rate schedule and their checkpointed state for the reference
trainer. Everything a resumed segment needs to continue bit-for-bit lives in two files of the
checkpoint directory: the HF weights (``model.safetensors``, loadable by
``LlamaForCausalLM.from_pretrained``) and ``trainer_state.pt`` (optimizer, schedule, RNG,
data position), loaded with ``weights_only=True`` so a checkpoint cannot run code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from jobscripts.trainer_config import TrainerConfig

STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class Position:
    """Where training stands: iterations done, samples consumed, and of those the samples
    consumed without training (``iterations_to_skip``; Megatron's skipped_train_samples)."""

    iteration: int = 0
    consumed: int = 0
    skipped: int = 0

    def trained_steps(self, global_batch_size: int) -> int:
        # Megatron's scheduler steps only on trained iterations, so the lr follows these.
        return self.iteration - self.skipped // global_batch_size


def lr_at(iteration: int, config: TrainerConfig) -> float:
    """Learning rate for the 1-based ``iteration``: linear warmup, then decay to min_lr.

    A pure function of the iteration, so the schedule needs no state to resume exactly.
    """
    warmup = config.lr_warmup_iters
    if warmup and iteration <= warmup:
        return config.lr * iteration / warmup
    if config.lr_decay_style == "constant":
        return config.lr
    decay_iters = config.lr_decay_iters or config.train_iters
    if iteration >= decay_iters:
        return config.min_lr
    progress = (iteration - warmup) / max(1, decay_iters - warmup)
    if config.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + coeff * (config.lr - config.min_lr)


def _schedule(config: TrainerConfig) -> dict:
    keys = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "train_iters")
    return {key: getattr(config, key) for key in keys}


def build_model(config: TrainerConfig, vocab_size: int, eod: int):
    """A seeded tiny Llama and AdamW with Megatron's grouping (no decay on norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    model_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups or config.num_attention_heads,
        max_position_embeddings=config.seq_length,
        rope_theta=config.rotary_base,
        rms_norm_eps=config.norm_epsilon,
        initializer_range=config.init_method_std,
        tie_word_embeddings=False,
        eos_token_id=eod,  # generation (vLLM, HF) stops at the documents' separator
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(model_config)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
    )
    return model, optimizer


def model_flops_per_token(config: TrainerConfig, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x matmul params + attention scores."""
    h, layers, s = config.hidden_size, config.num_layers, config.seq_length
    kv = h * (config.num_query_groups or config.num_attention_heads) // config.num_attention_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * config.ffn_size
    return 6.0 * (layers * per_layer + h * vocab_size) + 12.0 * layers * h * s


def capture_rng() -> dict:
    # numpy's key becomes a tensor so the state file loads with weights_only=True.
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"] = dict(numpy_state["state"])
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = dict(numpy_state["state"])
    numpy_state["state"]["key"] = numpy_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])


def write_state(directory: Path, optimizer, position: Position, config) -> None:
    torch.save(
        {
            "iteration": position.iteration,
            "consumed_samples": position.consumed,
            "skipped_samples": position.skipped,
            "optimizer": optimizer.state_dict(),
            "scheduler": _schedule(config),
            "rng": capture_rng(),
        },
        directory / STATE_FILE,
    )


def load_state(directory: Path, model, optimizer, config) -> Position:
    """Restore weights, optimizer and RNG in place; the training position they belong to.

    Weights go into the model built from the run config with ``strict=True``: an architecture
    that drifted between segments fails here instead of training a different model.
    """
    from safetensors.torch import load_file

    model.load_state_dict(load_file(directory / WEIGHTS_FILE), strict=True)
    state = torch.load(directory / STATE_FILE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    if state["scheduler"] != _schedule(config):
        # Allowed (a deliberate change of plan), but the run is then no longer the uncut one.
        print(f"WARNING: lr schedule changed since the checkpoint: {state['scheduler']} -> "
              f"{_schedule(config)}", flush=True)
    restore_rng(state["rng"])
    # Checkpoints from before iterations_to_skip existed skipped nothing.
    return Position(state["iteration"], state["consumed_samples"], state.get("skipped_samples", 0))
