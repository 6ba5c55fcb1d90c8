"""Evaluation throughput: vLLM's CPU build against the transformers backend, same windows.

Runs in the cluster's job venv (the one with vLLM; tests/bench/run_all.py picks it): the tiny
model of tests/export_eval is trained and exported, the held-out windows of its dataset are
built once (the evaluate step's own code), and each backend scores all of them after a warm-up
call. Prints one JSON line:

    {"bench": "evaluate", "tokens": N, "vllm_tokens_per_s": X, "hf_tokens_per_s": X,
     "max_abs_logprob_diff": X, ...}
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

ROUNDS = 3  # scoring passes per backend; the best is reported (the machine is shared)


def heldout_windows(trained, export: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from jobscripts.eval_data import heldout_documents, open_heldout
    from jobscripts.eval_metrics import windows

    eod = AutoTokenizer.from_pretrained(export).eos_token_id
    opened = open_heldout([str(trained.dataset)], trained.split)
    return [w for _, _, ids in heldout_documents(opened, eod)
            for w in windows(ids, eod, trained.seq_length - 1)]


def best_rate(backend, batch: list[list[int]], tokens: int) -> tuple[float, list[list[float]]]:
    backend.window_logprobs(batch[:2])  # warm-up: first-call allocations, thread pools
    best, values = 0.0, []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        values = backend.window_logprobs(batch)
        best = max(best, tokens / (time.perf_counter() - started))
    return best, values


def main() -> int:
    from jobscripts.eval_hf import TransformersBackend
    from jobscripts.eval_vllm import VllmBackend
    from tests.export_eval.conftest import train_model
    from tests.support.export import run_export

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        trained = train_model(base)
        export = base / "hf"
        rc, result = run_export(export, "--checkpoint-root", str(trained.root))
        assert rc == 0, result
        batch = heldout_windows(trained, export)
        tokens = sum(len(w) - 1 for w in batch)
        hf_rate, hf_values = best_rate(TransformersBackend(str(export), batch_size=32),
                                       batch, tokens)
        started = time.perf_counter()
        vllm = VllmBackend(str(export), trained.seq_length)
        engine_s = time.perf_counter() - started
        vllm_rate, vllm_values = best_rate(vllm, batch, tokens)
    diff = max(abs(a - b) for hv, vv in zip(hf_values, vllm_values, strict=True)
               for a, b in zip(hv, vv, strict=True))
    print(json.dumps({"bench": "evaluate", "tokens": tokens, "windows": len(batch),
                      "vllm_tokens_per_s": round(vllm_rate, 1),
                      "hf_tokens_per_s": round(hf_rate, 1),
                      "max_abs_logprob_diff": diff,
                      "vllm_import_and_engine_s": round(engine_s, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
