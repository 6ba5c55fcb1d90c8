"""Production evaluation backends: vLLM's offline engine and lm-evaluation-harness.

1. ``VllmBackend``: offline ``vllm.LLM``, the default, on a GPU node in the vLLM image and on
   the local cluster with vLLM's CPU build (docker/requirements-vllm.txt). Perplexity windows
   go in as token ids with ``SamplingParams(max_tokens=1, prompt_logprobs=1)``; the engine's
   settings (sizes bounded for prompt log-probs, CPU fast start) are jobscripts/vllm_engine.py's.
   Whatever vLLM refuses (a missing tokenizer or weights, a shape it does not support) fails
   the step with vLLM's own reason.
2. The OpenAI-compatible server: jobscripts/eval_vllm_server.py.
3. ``run_lm_eval``: lm-evaluation-harness on the vLLM model with a local task directory, in a
   child process (``python -m jobscripts.eval_vllm``, built by ``lm_eval_command``).

vLLM and lm-eval are imported inside the functions: this module imports anywhere. Backends 1
and 2 answer the same interface as jobscripts/eval_hf.py, and their outputs go through the
one metric path in jobscripts/eval_metrics.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jobscripts.common import StepError, log
from jobscripts.eval_metrics import from_prompt_logprobs
from jobscripts.results import write_json_atomic
from jobscripts.vllm_engine import (
    CPU_ENVIRONMENT,
    DTYPE_BYTES,
    EngineLimits,
    engine_kwargs,
    engine_limits,
    model_shape,
)


# --- 1. offline LLM ---------------------------------------------------------------------------
def on_cpu() -> bool:
    """The CPU build (the local cluster) or a GPU: decides the engine settings."""
    import torch

    return not torch.cuda.is_available()


def limits_for(model_dir: str, max_model_len: int, cpu: bool) -> EngineLimits:
    """``engine_limits`` for this export on this machine; a bad export names its file."""
    try:
        vocab_size, max_positions, dtype = model_shape(model_dir)
        memory = None
        if not cpu:  # through NVML, as vLLM sizes its defaults: no CUDA context here
            from vllm.platforms import current_platform

            memory = current_platform.get_device_total_memory()
        logits_dtype = "float32" if cpu or dtype not in DTYPE_BYTES else dtype
        return engine_limits(max_model_len, vocab_size, logits_dtype, memory, max_positions)
    except ValueError as exc:
        raise StepError(f"vLLM engine for {model_dir}: {exc}") from exc


def vllm_reason(exc: BaseException) -> str:
    """vLLM's own words for a failure: the exception and, when it wraps another, the root."""
    text = f"{type(exc).__name__}: {exc}"
    root = exc
    while root.__cause__ is not None or (root.__context__ is not None
                                         and not root.__suppress_context__):
        root = root.__cause__ or root.__context__
    if root is not exc:
        text += f" (caused by {type(root).__name__}: {root})"
    return text


def engine_settings(model_dir: str, max_model_len: int, seed: int = 0,
                    tensor_parallel_size: int = 1) -> tuple[dict[str, object], bool]:
    """(the engine's keyword arguments, on the CPU build) for this export on this machine."""
    cpu = on_cpu()
    limits = limits_for(model_dir, max_model_len, cpu)
    return engine_kwargs(model_dir, limits, cpu, seed, tensor_parallel_size), cpu


class VllmBackend:
    name = "vllm"

    def __init__(self, model_dir: str, max_model_len: int, seed: int = 0,
                 tensor_parallel_size: int = 1):
        kwargs, cpu = engine_settings(model_dir, max_model_len, seed, tensor_parallel_size)
        if cpu:  # read when vLLM is imported: before it
            for key, value in CPU_ENVIRONMENT.items():
                os.environ.setdefault(key, value)
        log(f"vLLM engine: {kwargs}")
        self.model_dir = model_dir
        try:
            from vllm import LLM

            self.llm = LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 (whatever vLLM refuses, in its words)
            raise StepError(f"vLLM could not load {model_dir}: {vllm_reason(exc)}") from exc

    def window_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        # The one generated token is discarded; only prompt_logprobs matter. Outputs come
        # back in the order of the prompts.
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
        outputs = self._generate(windows, params)
        return [from_prompt_logprobs(o.prompt_logprobs, o.prompt_token_ids) for o in outputs]

    def complete(self, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int, eos_id: int | None) -> list[list[int]]:
        from vllm import SamplingParams

        # vLLM stops at the EOS of the model's generation_config; eos_id is for the HF path.
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
        outputs = self._generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def _generate(self, prompts: list[list[int]], params) -> list:
        # Some refusals come only with the first forward pass (the CPU build's attention
        # kernels check the head size there): in vLLM's words as well.
        try:
            return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                     use_tqdm=False)
        except Exception as exc:  # noqa: BLE001
            raise StepError(f"vLLM failed on {self.model_dir}: {vllm_reason(exc)}") from exc


# --- 3. lm-evaluation-harness ----------------------------------------------------------------
# lm-eval builds its own vllm.LLM. It runs in a child process that exits before the offline
# backend starts: a second LLM in the same process would find the GPU memory still held.
def lm_eval_command(model_dir: str, tasks: list[str], include_path: str | None,
                    max_model_len: int, output: str, limit: int | None = None,
                    seed: int = 0) -> list[str]:
    command = [sys.executable, "-m", "jobscripts.eval_vllm", "--model", model_dir,
               "--tasks", ",".join(tasks), "--max-model-len", str(max_model_len),
               "--seed", str(seed), "--output", output]
    if include_path:
        command += ["--include-path", include_path]
    if limit is not None:
        command += ["--limit", str(limit)]
    return command


def run_lm_eval_child(command: list[str], output: Path) -> dict[str, dict[str, Any]]:
    log(f"running lm-evaluation-harness: {' '.join(command)}")
    code = subprocess.run(command, check=False).returncode
    if code != 0 or not output.is_file():
        raise StepError(f"lm-evaluation-harness exited with code {code} (its log is above)")
    return json.loads(output.read_text(encoding="utf-8"))


def run_lm_eval(model_dir: str, tasks: list[str], include_path: str | None, max_model_len: int,
                limit: int | None = None, seed: int = 0) -> dict[str, dict[str, Any]]:
    """``{task: {metric: value}}`` from lm-eval's vLLM model; ``include_path`` is a directory
    of local task YAMLs (the cluster has no route to the hub's datasets)."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    model_args = {"pretrained": model_dir, "max_model_len": max_model_len,
                  "enable_prefix_caching": False, "seed": seed}
    results = evaluator.simple_evaluate(
        model="vllm", model_args=model_args, tasks=tasks, limit=limit,
        task_manager=TaskManager(include_path=include_path) if include_path else None)
    return lm_eval_summary(results)


def lm_eval_summary(results: dict) -> dict[str, dict[str, Any]]:
    """The numeric per-task metrics of a ``simple_evaluate`` result (keys like ``acc,none``)."""
    return {task: {k: v for k, v in metrics.items() if isinstance(v, int | float)}
            for task, metrics in (results or {}).get("results", {}).items()}


def main(argv: list[str] | None = None) -> int:
    """The child process of ``lm_eval_command``: run lm-eval, write its summary JSON."""
    parser = argparse.ArgumentParser(prog="python -m jobscripts.eval_vllm")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--include-path")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    summary = run_lm_eval(args.model, args.tasks.split(","), args.include_path,
                          args.max_model_len, args.limit, args.seed)
    write_json_atomic(args.output, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
