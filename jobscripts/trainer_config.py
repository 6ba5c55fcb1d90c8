"""Run configuration of the CPU reference trainer: plain defaults, one comment each.

Keys use Megatron's argument names (``--train-iters`` -> ``train_iters``) so the campaign
config maps onto both paths the same way. The Airflow side renders a JSON file with these
keys; an unknown key is an error that names it, because a misspelt key silently ignored
(as Bridge does with YAML) trains the wrong run for hours.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobscripts.job_files import SEGMENT_RESULT


@dataclass
class TrainerConfig:
    # data: Megatron's --data-path: ["prefix"] or a blend ["30", "prefixA", "70", "prefixB"]
    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"  # train,valid,test weights over documents, as Megatron
    data_cache_path: str | None = None  # dataset index cache; default <save>/data_cache
    # tokenizer: a directory AutoTokenizer loads (vocab size and EOD come from it) ...
    tokenizer_model: str | None = None
    # ... or, for synthetic data, the two numbers directly
    vocab_size: int | None = None
    eod_id: int | None = None
    # model: a tiny Llama
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int | None = None  # default: Llama's 8/3 x hidden, rounded up to 16
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # grouped-query attention; default = heads
    seq_length: int = 64
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    # training: the dataset is sized by train_iters, so keep it fixed across segments
    train_iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 4  # gradient accumulation = global / micro
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # default train_iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    seed: int = 1234
    # Megatron's --iterations-to-skip: value k skips the step taken with k iterations done
    # (logged as k+1 had it trained): its global batch is consumed, not trained, and the lr
    # schedule does not advance. [N, N+1, ..., N+K-1] after a resume from N skips the next K.
    iterations_to_skip: list[int] = field(default_factory=list)
    # validation: the same first eval_iters batches of the valid split each time
    eval_interval: int | None = None  # None or 0: no validation
    eval_iters: int = 2
    log_interval: int = 1
    # checkpoints (checkpoints.py defines the layout)
    save: str = ""
    load: str | None = None  # default: save
    save_interval: int | None = None  # None: save only when stopping
    keep_last: int | None = None  # retention: keep the last K complete checkpoints ...
    keep_every: int | None = None  # ... plus every Mth iteration; None keeps all
    # stopping; each stop saves first
    exit_duration_in_mins: float | None = None  # wall time since start, checked every iteration
    exit_interval: int | None = None  # stop when iteration % exit_interval == 0
    exit_signal_handler: bool = True  # SIGTERM/SIGUSR1: save and stop
    # runtime
    # Fixed, so float reductions happen in the same order every run. 1 by default: OpenMP
    # threads spin-wait, and on a shared or oversubscribed node 2 threads ran 10x slower.
    num_threads: int = 1
    # Under torchrun (several ranks): how long a collective waits for a peer (Megatron's
    # --distributed-timeout-minutes). Slurm's --kill-on-bad-exit usually ends a broken job first.
    distributed_timeout_minutes: float = 10.0
    segment_result: str = SEGMENT_RESULT

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return -(-(8 * self.hidden_size // 3) // 16) * 16

    @property
    def load_dir(self) -> str:
        return self.load or self.save

    @property
    def grad_accumulation(self) -> int:
        return self.global_batch_size // self.micro_batch_size


def _type_ok(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType):
        return any(_type_ok(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def validate(config: TrainerConfig) -> None:
    """Raise ValueError naming the first bad field; cross-field rules included."""
    hints = typing.get_type_hints(TrainerConfig)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _type_ok(value, hints[f.name]):
            raise ValueError(f"{f.name}: expected {hints[f.name]}, got {value!r}")
    problems = []
    if not config.data_path:
        problems.append("data_path: at least one prefix is required")
    if not config.save:
        problems.append("save: a checkpoint directory is required")
    if config.tokenizer_model is None and (config.vocab_size is None or config.eod_id is None):
        problems.append("tokenizer_model, or vocab_size and eod_id, are required")
    if config.global_batch_size % config.micro_batch_size:
        problems.append("global_batch_size must be a multiple of micro_batch_size")
    if config.hidden_size % config.num_attention_heads:
        problems.append("hidden_size must be a multiple of num_attention_heads")
    if config.lr_decay_style not in ("cosine", "linear", "constant"):
        problems.append(f"lr_decay_style: unknown style {config.lr_decay_style!r}")
    for name in ("keep_last", "keep_every"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            problems.append(f"{name} must be at least 1 (or null to keep everything)")
    if any(i < 0 for i in config.iterations_to_skip):
        problems.append("iterations_to_skip: iterations must not be negative")
    if config.min_lr > config.lr:
        problems.append("min_lr must not exceed lr")
    for name in ("train_iters", "global_batch_size", "micro_batch_size", "seq_length",
                 "log_interval", "num_threads", "eval_iters", "distributed_timeout_minutes"):
        if getattr(config, name) < 1:
            problems.append(f"{name} must be at least 1")
    if problems:
        raise ValueError("; ".join(problems))


def from_dict(raw: dict[str, Any]) -> TrainerConfig:
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(unknown)}")
    config = TrainerConfig(**raw)
    validate(config)
    return config


def load_config(
    path: str | os.PathLike[str], overrides: dict[str, Any] | None = None
) -> TrainerConfig:
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_dict(raw)
