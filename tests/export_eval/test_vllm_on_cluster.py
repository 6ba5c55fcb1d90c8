"""vLLM's CPU build, for real, on the local cluster: the campaign's evaluate stage and its failures.

vLLM-heavy (marker ``vllm``): every job here imports vLLM (20-45 s). The jobs are batched:
the package's two evaluations (cluster_site.py) serve the cross-check; the three refused
exports and the one server run go in one pool of three jobs at a time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from operators.campaign.render import stages
from operators.campaign.schema.load import campaign_from_dict
from tests.export_eval.cluster_site import LOGPROBS_FILE, USER, run_stage
from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def log_probabilities(run_dir: Path) -> tuple[list[list[int]], list[list[float]]]:
    dumped = json.loads((run_dir / LOGPROBS_FILE).read_text())
    return dumped["windows"], dumped["logprobs"]


def test_the_evaluate_stage_scores_with_vllm_as_transformers_does(site, evaluations):
    from jobscripts.eval_hf import TransformersBackend

    after, before = evaluations
    assert after["ok"] and before["ok"], (after, before)
    assert after["backend"] == before["backend"] == "vllm"
    windows, vllm_values = log_probabilities(site.base / "runs" / "evaluate")
    assert sum(len(w) - 1 for w in windows) == after["tokens_evaluated"] > 0
    # The same export and windows through transformers here: per-token agreement.
    hf_values = TransformersBackend(site.layout.hf_export, batch_size=16).window_logprobs(windows)
    diff = max(abs(a - b) for hv, vv in zip(hf_values, vllm_values, strict=True)
               for a, b in zip(hv, vv, strict=True))
    assert diff <= 1e-4, diff
    nll = -sum(sum(v) for v in hf_values) / after["tokens_evaluated"]
    assert after["nll_per_token"] == pytest.approx(nll, abs=1e-5)
    assert after["samples"] and all(s["completion"] is not None for s in after["samples"])


def write_refused_shape(directory: Path, tokenizer: str) -> None:
    """A Llama whose head size (64 / 4 = 16) vLLM's CPU attention has no kernel for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, eos_token_id=0, bos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(directory)
    for item in Path(tokenizer).iterdir():
        shutil.copy2(item, directory / item.name)


@pytest.fixture(scope="module")
def vllm_jobs(site, cluster_export) -> dict[str, dict]:
    """The evaluate stage on three broken exports and in server mode: name -> result JSON."""
    bad = site.base / "bad"
    export = Path(site.layout.hf_export)
    for name in ("no_tokenizer", "no_weights"):
        shutil.copytree(export, bad / name)
    for name in TOKENIZER_FILES:
        (bad / "no_tokenizer" / name).unlink(missing_ok=True)
    (bad / "no_weights" / "model.safetensors").unlink()
    write_refused_shape(bad / "head_dim_16", site.layout.tokenizer)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(bad)], check=True)

    stage = stages.evaluate(campaign_from_dict(site.campaign), site.layout)
    jobs = {name: ({**stage, "command": stage["command"].replace(str(export), str(bad / name))},
                   False) for name in ("no_tokenizer", "no_weights", "head_dim_16")}
    served = stage["command"].replace("--backend vllm", "--backend vllm-server")
    assert served != stage["command"]
    jobs["server"] = ({**stage, "command": served}, True)
    with ThreadPoolExecutor(3) as pool:  # the server first: the longest
        futures = {name: pool.submit(run_stage, job, site.base / "runs" / f"vllm-{name}", ok)
                   for name, (job, ok) in sorted(jobs.items(), key=lambda j: j[0] != "server")}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name, reasons", [
    ("no_tokenizer", ["cannot load the tokenizer"]),
    ("no_weights", ["vLLM could not load", "Cannot find any model weights"]),
    ("head_dim_16", ["vLLM failed on", "Unsupported CPU attention configuration: head_dim=16"]),
])
def test_a_broken_export_fails_the_job_with_the_reason(vllm_jobs, site, name, reasons):
    result = vllm_jobs[name]
    assert result["ok"] is False
    for reason in reasons:
        assert reason in result["error"], result["error"]
    assert str(site.base / "bad" / name) in result["error"]


def test_the_openai_server_scores_the_same_and_leaves_nothing_behind(vllm_jobs, evaluations):
    result, offline = vllm_jobs["server"], evaluations[0]
    assert result["ok"] and result["backend"] == "vllm-server", result
    server = result["server"]
    assert server["port_closed"] is True and server["startup_seconds"] > 0
    assert result["tokens_evaluated"] == offline["tokens_evaluated"]
    assert result["nll_per_token"] == pytest.approx(offline["nll_per_token"], abs=1e-5)
    # Checked from outside, after the job: nothing listens on its port on any node (each has
    # its own 127.0.0.1), and no process of it (the server's pid, or any api_server on that
    # port) is left.
    assert cluster.port_open_on_nodes(server["port"]) == []
    assert not Path(f"/proc/{server['pid']}").exists()
    left = subprocess.run(["pgrep", "-f", f"{SERVER_MODULE}.*--port {server['port']}"],
                          capture_output=True, text=True)
    assert left.returncode == 1 and not left.stdout, left.stdout
