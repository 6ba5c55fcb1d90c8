"""Production evaluation backends, for the vLLM container on a GPU node: three separate ways in.

1. ``VllmBackend``: offline ``vllm.LLM``, the default. Perplexity windows go in as token ids
   with ``SamplingParams(max_tokens=1, prompt_logprobs=1)``; prefix caching is off (cached
   prefix positions would get no prompt log-probabilities) and ``max_model_len`` is the
   training sequence length.
2. ``ServerBackend``: an OpenAI-compatible ``vllm serve`` (started here or already running);
   ``/v1/completions`` with ``echo=True, logprobs=1, max_tokens=0`` returns the prompt's
   log-probabilities. Slower, but it checks the deployment users will actually call.
3. ``run_lm_eval``: lm-evaluation-harness on the vLLM model with a local task directory, in a
   child process (``python -m jobscripts.eval_vllm``, built by ``lm_eval_command``).

vLLM, requests-free HTTP aside, and lm-eval are imported inside the functions: this module
imports anywhere (CI has no vLLM). Backends 1 and 2 answer the same interface as
jobscripts/eval_hf.py, and their outputs go through the one metric path in
jobscripts/eval_metrics.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from jobscripts.common import StepError, log
from jobscripts.eval_metrics import from_openai_echo, from_prompt_logprobs
from jobscripts.results import write_json_atomic


# --- 1. offline LLM ---------------------------------------------------------------------------
class VllmBackend:
    name = "vllm"

    def __init__(self, model_dir: str, max_model_len: int, dtype: str = "auto", seed: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85):
        from vllm import LLM

        self.llm = LLM(model=model_dir, max_model_len=max_model_len,
                       enable_prefix_caching=False, dtype=dtype, seed=seed,
                       tensor_parallel_size=tensor_parallel_size,
                       gpu_memory_utilization=gpu_memory_utilization)

    def window_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        # The one generated token is discarded; only prompt_logprobs matter. Outputs come
        # back in the order of the prompts.
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
        outputs = self.llm.generate([{"prompt_token_ids": w} for w in windows], params,
                                    use_tqdm=False)
        return [from_prompt_logprobs(o.prompt_logprobs, o.prompt_token_ids) for o in outputs]

    def complete(self, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int, eos_id: int | None) -> list[list[int]]:
        from vllm import SamplingParams

        # vLLM stops at the EOS of the model's generation_config; eos_id is for the HF path.
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


# --- 2. OpenAI-compatible server -------------------------------------------------------------
def serve_command(model_dir: str, port: int, max_model_len: int, served_name: str,
                  host: str = "127.0.0.1") -> list[str]:
    """``vllm serve`` with the same settings as the offline backend."""
    return ["vllm", "serve", model_dir, "--host", host, "--port", str(port),
            "--served-model-name", served_name, "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching"]


def echo_request(served_name: str, windows: list[list[int]]) -> dict[str, Any]:
    """The ``/v1/completions`` body that returns prompt log-probabilities only."""
    return {"model": served_name, "prompt": windows, "echo": True, "logprobs": 1,
            "max_tokens": 0, "temperature": 0.0}


def _post(url: str, body: dict, timeout: float) -> dict:
    if not url.startswith(("http://", "https://")):
        raise StepError(f"server URL must be http(s): {url}")
    request = urllib.request.Request(url, data=json.dumps(body).encode(),  # noqa: S310 (checked)
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return json.loads(response.read())


def wait_healthy(base_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StepError(f"vllm serve exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:  # noqa: S310
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise StepError(f"{base_url}/health did not answer 200 within {timeout:.0f} s")


class ServerBackend:
    name = "vllm-server"

    def __init__(self, base_url: str, served_name: str, batch_size: int = 16,
                 timeout: float = 600.0):
        self.base_url, self.served_name = base_url.rstrip("/"), served_name
        self.batch_size, self.timeout = batch_size, timeout

    def window_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        results: list[list[float]] = []
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start:start + self.batch_size]
            reply = _post(f"{self.base_url}/v1/completions",
                          echo_request(self.served_name, batch), self.timeout)
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            results.extend(from_openai_echo(c, len(w)) for c, w in zip(choices, batch,
                                                                      strict=True))
        return results

    def complete(self, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int, eos_id: int | None) -> list[list[int]]:
        outputs = []
        for prompt in prompts:
            body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_new_tokens,
                    "temperature": temperature, "seed": seed, "return_token_ids": True}
            choice = _post(f"{self.base_url}/v1/completions", body, self.timeout)["choices"][0]
            outputs.append(list(choice["token_ids"]))
        return outputs


class ServedModel:
    """``vllm serve`` as a child process for the length of a ``with`` block."""

    def __init__(self, model_dir: str, port: int, max_model_len: int, served_name: str,
                 log_path: Path, startup_timeout: float = 900.0):
        self.command = serve_command(model_dir, port, max_model_len, served_name)
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path, self.startup_timeout = log_path, startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServedModel:
        log(f"starting {' '.join(self.command)} (log: {self.log_path})")
        with open(self.log_path, "ab") as handle:
            self.proc = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT)
        wait_healthy(self.base_url, self.startup_timeout, self.proc)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
