"""How the evaluation's vLLM engine is sized and started. Pure: no vLLM or torch import.

One definition of the engine's settings, used by the offline ``vllm.LLM`` backend and, turned
into command-line flags, by the OpenAI-compatible server (jobscripts/eval_vllm_server.py), so
both score with the same engine.

Why the batch is bounded: prompt log-probabilities (perplexity) are computed per request after
the forward pass, outside what vLLM's start-up memory profile measures. For a request chunk of
``n`` tokens vLLM builds the logits (model dtype), their float32 copy and the float32
log-softmax, each ``n x vocab``; a chunk is at most ``max_num_batched_tokens`` tokens. vLLM's
default batch on an 80 GB GPU is 16,384 tokens: for Llama 3's 128,256-entry vocabulary that is
over 12 GB that vLLM never reserved (``gpu_memory_utilization=0.85`` leaves 12 GB for
everything else). ``engine_limits`` picks the largest batch whose log-probabilities fit in the
memory left outside ``gpu_memory_utilization`` and a fixed reserve (CUDA context, NCCL,
allocator fragmentation); with a smaller batch vLLM's chunked prefill still takes windows up
to ``max_model_len``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GPU_MEMORY_UTILIZATION = 0.85  # vLLM's share: weights, activations (profiled), KV cache
GPU_RESERVE_FRACTION = 0.05  # CUDA context, NCCL buffers, fragmentation: never vLLM's, never ours
MIN_GPU_MEMORY_UTILIZATION = 0.5  # below this the model would hardly have KV cache left
CPU_LOGPROB_BUDGET = 1 << 30  # bytes of RAM for prompt log-probs on the CPU build
BATCH_ALIGN = 256  # batch sizes in whole blocks of 256 tokens
MIN_BATCHED_TOKENS = 256
MAX_BATCHED_TOKENS = 8192  # no throughput to gain beyond this for scoring, only memory to lose
MAX_NUM_SEQS = 256
FLOAT32_BYTES = 4
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# The CPU build's fast start (measured: ~7 s to build the engine after the import instead of
# minutes): the engine core in this process, no worker processes, no graph capture, no
# compilation, a 1 GiB KV cache (the default is sized for serving, and scoring needs little).
# No thread pinning: by default vLLM binds its threads to cores, and two evaluations sharing a
# node's cores (the local cluster does not give jobs cores of their own) then spin on the
# same ones: scoring took 3x as long as unpinned, measured with two at once.
CPU_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
CPU_ENGINE = {"enforce_eager": True, "dtype": "float32", "distributed_executor_backend": "uni"}


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    logprob_peak_bytes: int  # prompt log-probs of one full batch, outside vLLM's profile


def logprob_bytes_per_token(vocab_size: int, logits_dtype: str) -> int:
    """Bytes one prompt position's log-probabilities take: logits, float32 copy, log-softmax."""
    if logits_dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (got {logits_dtype!r})")
    return vocab_size * (DTYPE_BYTES[logits_dtype] + 2 * FLOAT32_BYTES)


def batch_tokens_within(budget_bytes: float, per_token: int) -> int:
    """The largest aligned batch whose log-probs fit in ``budget_bytes``, capped (0: none)."""
    tokens = int(budget_bytes // per_token) // BATCH_ALIGN * BATCH_ALIGN
    return min(tokens, MAX_BATCHED_TOKENS)


def engine_limits(max_model_len: int, vocab_size: int, logits_dtype: str,
                  device_memory_bytes: int | None, max_positions: int | None = None,
                  gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> EngineLimits:
    """Engine sizes for scoring windows of ``max_model_len`` tokens.

    ``device_memory_bytes``: the GPU's total memory, or None on the CPU build (a fixed RAM
    budget). When even the smallest batch does not fit outside ``gpu_memory_utilization``,
    the utilization is lowered to make room, down to a floor below which this is an error.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 (got {max_model_len})")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive (got {vocab_size})")
    if max_positions is not None and max_model_len > max_positions:
        raise ValueError(f"max_model_len {max_model_len} is longer than the model's "
                         f"max_position_embeddings {max_positions}")
    per_token = logprob_bytes_per_token(vocab_size, logits_dtype)
    if device_memory_bytes is None:
        budget, utilization = CPU_LOGPROB_BUDGET, gpu_memory_utilization
    else:
        utilization = gpu_memory_utilization
        budget = device_memory_bytes * (1.0 - utilization - GPU_RESERVE_FRACTION)
    tokens = batch_tokens_within(budget, per_token)
    if tokens < MIN_BATCHED_TOKENS:
        tokens = MIN_BATCHED_TOKENS
        if device_memory_bytes is not None:
            utilization = 1.0 - GPU_RESERVE_FRACTION - tokens * per_token / device_memory_bytes
            utilization = int(utilization * 100) / 100  # round down: never less headroom
            if utilization < MIN_GPU_MEMORY_UTILIZATION:
                raise ValueError(
                    f"a vocabulary of {vocab_size} needs {tokens * per_token / 2**30:.1f} GiB "
                    f"for {tokens} tokens of prompt log-probs: too much for a GPU of "
                    f"{device_memory_bytes / 2**30:.1f} GiB")
    return EngineLimits(max_model_len, tokens, min(MAX_NUM_SEQS, tokens), utilization,
                        tokens * per_token)


def model_shape(model_dir: str | Path) -> tuple[int, int | None, str]:
    """(vocab_size, max_position_embeddings, dtype) from the export's ``config.json``."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    config = config.get("text_config", config)
    if not isinstance(config.get("vocab_size"), int):
        raise ValueError(f"{path}: no integer vocab_size")
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return config["vocab_size"], config.get("max_position_embeddings"), str(dtype)


def engine_kwargs(model_dir: str, limits: EngineLimits, cpu: bool, seed: int = 0,
                  tensor_parallel_size: int = 1) -> dict[str, object]:
    """``vllm.LLM`` keyword arguments (and, through ``cli_flags``, the server's).

    Prefix caching is off: cached prefix positions would get no prompt log-probabilities."""
    kwargs: dict[str, object] = {
        "model": model_dir, "max_model_len": limits.max_model_len,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "max_num_seqs": limits.max_num_seqs, "enable_prefix_caching": False, "seed": seed}
    if cpu:
        return {**kwargs, **CPU_ENGINE}
    return {**kwargs, "dtype": "auto", "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": limits.gpu_memory_utilization}


def cli_flags(kwargs: dict[str, object]) -> list[str]:
    """``engine_kwargs`` as vLLM's command-line flags (``--max-model-len 128``, booleans as
    ``--enforce-eager`` / ``--no-enable-prefix-caching``)."""
    flags: list[str] = []
    for key, value in kwargs.items():
        name = key.replace("_", "-")
        if value is True:
            flags.append(f"--{name}")
        elif value is False:
            flags.append(f"--no-{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags
