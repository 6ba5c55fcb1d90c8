"""A Hugging Face cache (HF_HOME) holding only the model config a Llama 3.1 recipe reads.

Bridge's ``llama31_8b_pretrain_config`` calls ``AutoBridge.from_hf_pretrained(
"meta-llama/Meta-Llama-3.1-8B")``; offline, transformers finds ``config.json`` through the hub
cache's layout (``hub/models--ORG--NAME/refs/main`` -> ``snapshots/<commit>/``). The values
are Llama 3.1 8B's published architecture (written here: nothing is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_ID = "meta-llama/Meta-Llama-3.1-8B"
COMMIT = "0" * 40  # any commit name: refs/main points at it
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}


def write_hf_home(root: Path, repo_id: str = REPO_ID, config: dict | None = None) -> Path:
    model = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = model / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (model / "refs").mkdir(exist_ok=True)
    (model / "refs" / "main").write_text(COMMIT)
    (snapshot / "config.json").write_text(json.dumps(config or LLAMA31_8B_CONFIG, indent=1))
    return root
