"""vLLM's engine sizes for scoring (issue 12 point 10): pure, no vLLM needed."""

from __future__ import annotations

import json

import pytest

from jobscripts.vllm_engine import (
    CPU_ENGINE,
    GPU_MEMORY_UTILIZATION,
    GPU_RESERVE_FRACTION,
    MAX_BATCHED_TOKENS,
    cli_flags,
    engine_kwargs,
    engine_limits,
    logprob_bytes_per_token,
    model_shape,
)

pytestmark = pytest.mark.pure
GIB = 1 << 30
LLAMA3_VOCAB = 128_256
H100 = 80 * GIB


def test_an_8b_llama_on_one_80gb_gpu_keeps_prompt_logprobs_outside_vllms_share():
    limits = engine_limits(8192, LLAMA3_VOCAB, "bfloat16", H100, max_positions=131_072)
    per_token = logprob_bytes_per_token(LLAMA3_VOCAB, "bfloat16")
    assert per_token == LLAMA3_VOCAB * (2 + 4 + 4)  # bf16 logits, their f32 copy, f32 logsoftmax
    # vLLM's own default on an 80 GB GPU (16,384 tokens) would need ~21 GB there.
    assert 16_384 * per_token > 19 * GIB
    free = H100 * (1 - limits.gpu_memory_utilization - GPU_RESERVE_FRACTION)
    assert limits.logprob_peak_bytes == limits.max_num_batched_tokens * per_token <= free
    assert limits.gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    assert 4096 <= limits.max_num_batched_tokens < 8192  # chunked prefill takes 8k windows
    assert limits.max_num_batched_tokens % 256 == 0
    assert limits.max_num_seqs <= limits.max_num_batched_tokens  # vLLM refuses otherwise
    assert limits.max_model_len == 8192


def test_a_big_gpu_is_capped_and_a_small_one_lowers_the_utilization():
    big = engine_limits(8192, LLAMA3_VOCAB, "bfloat16", 141 * GIB)
    assert big.max_num_batched_tokens == MAX_BATCHED_TOKENS
    small = engine_limits(4096, LLAMA3_VOCAB, "bfloat16", 16 * GIB)
    assert small.max_num_batched_tokens == 1280
    tiny = engine_limits(4096, LLAMA3_VOCAB, "bfloat16", 2 * GIB)  # room made for 256 tokens
    assert tiny.max_num_batched_tokens == 256 and tiny.gpu_memory_utilization < 0.85
    assert tiny.logprob_peak_bytes <= 2 * GIB * (1 - tiny.gpu_memory_utilization
                                                 - GPU_RESERVE_FRACTION)
    with pytest.raises(ValueError, match="too much for a GPU of 0.5 GiB"):
        engine_limits(4096, LLAMA3_VOCAB, "bfloat16", GIB // 2)


def test_cpu_limits_and_bad_inputs():
    cpu = engine_limits(128, 2048, "float32", None)
    assert cpu.max_num_batched_tokens == MAX_BATCHED_TOKENS  # 1 GiB of RAM for 16 KB/token
    assert engine_limits(128, 2_000_000, "float32", None).max_num_batched_tokens == 256
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        engine_limits(4096, 256, "float32", None, max_positions=2048)
    with pytest.raises(ValueError, match="at least 2"):
        engine_limits(1, 256, "float32", None)
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_limits(64, 256, "int8", None)


def test_engine_kwargs_and_flags_say_the_same():
    limits = engine_limits(8192, LLAMA3_VOCAB, "bfloat16", H100)
    gpu = engine_kwargs("/m", limits, cpu=False, seed=3)
    assert gpu["max_num_batched_tokens"] == limits.max_num_batched_tokens
    assert gpu["gpu_memory_utilization"] == limits.gpu_memory_utilization
    assert gpu["enable_prefix_caching"] is False and gpu["seed"] == 3
    assert not set(CPU_ENGINE) - {"dtype"} & set(gpu)
    cpu = engine_kwargs("/m", engine_limits(128, 256, "float32", None), cpu=True)
    assert {k: cpu[k] for k in CPU_ENGINE} == CPU_ENGINE and "gpu_memory_utilization" not in cpu
    flags = cli_flags(gpu)
    assert flags[flags.index("--max-num-batched-tokens") + 1] == str(
        limits.max_num_batched_tokens)
    assert "--no-enable-prefix-caching" in flags and "--enable-prefix-caching" not in flags
    assert "--enforce-eager" in cli_flags(cpu)


def test_model_shape_reads_the_exports_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 256, "max_position_embeddings": 32, "torch_dtype": "bfloat16"}))
    assert model_shape(tmp_path) == (256, 32, "bfloat16")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 9}}))
    assert model_shape(tmp_path) == (9, None, "float32")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        model_shape(tmp_path)
