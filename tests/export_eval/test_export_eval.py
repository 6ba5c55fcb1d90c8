"""Export of the tiny reference model to Hugging Face format, and its evaluation on CPU."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from jobscripts import checkpoints
from tests.support.export import TRAIN_ITERS, run_export


def run_eval(model: Path, trained, out: Path, *flags: str, data: list[str] | None = None
             ) -> dict:
    from jobscripts.evaluate import main

    data = data or ["--data", str(trained.heldout)]
    rc = main(["--model", str(model), *data, "--max-model-len", str(trained.seq_length),
               "--output-dir", str(out), *flags])
    result = json.loads((out / "eval.json").read_text())
    assert rc == 0, result
    return result


def eval_error(model: Path, out: Path, *args: str) -> str:
    """The error of an evaluation that must fail (exit code 1), from its result JSON."""
    from jobscripts.evaluate import main

    rc = main(["--model", str(model), *args, "--max-model-len", "32", "--output-dir", str(out)])
    result = json.loads((out / "eval.json").read_text())
    assert rc == 1, result
    return result["error"]


def test_export_latest_is_complete_and_gives_the_checkpoints_logits(exported, trained):
    from transformers import AutoTokenizer

    output, result = exported
    assert result["ok"] and result["mode"] == "reference"
    assert result["iteration"] == TRAIN_ITERS  # the tracker's, by default
    assert set(result["files"]) >= {"config.json", "model.safetensors", "generation_config.json",
                                    "tokenizer.json", "tokenizer_config.json"}
    assert not {"trainer_state.pt", checkpoints.COMPLETE_MARKER} & set(result["files"])
    assert result["files"] == {p.name: p.stat().st_size for p in output.iterdir()}
    verification = result["verification"]
    assert verification["max_abs_logit_diff"] <= verification["atol"] == 1e-5
    assert verification["tensors_checked"] > 0 and verification["tokenizer_size"] == 256
    assert AutoTokenizer.from_pretrained(output).eos_token_id == 0
    # Built beside the output and renamed: nothing half-written is left next to it.
    assert sorted(p.name for p in output.parent.iterdir()) == [
        "hf", "hf.export.json", "hf.result.json"]
    # The listing registration fetches by: the published directory's files, as verified.
    listing = json.loads((output.parent / "hf.export.json").read_text())
    assert listing["ok"] and listing["files"] == result["files"]
    assert listing["iteration"] == TRAIN_ITERS


def test_export_a_chosen_iteration_over_an_earlier_export(trained, tmp_path):
    output = tmp_path / "hf"
    rc, first = run_export(output, "--checkpoint-root", str(trained.root))
    assert rc == 0 and first["iteration"] == TRAIN_ITERS
    rc, again = run_export(output, "--checkpoint-root", str(trained.root),
                           "--iteration", str(TRAIN_ITERS // 2))
    assert rc == 0, again
    assert again["iteration"] == TRAIN_ITERS // 2
    assert again["verification"]["max_abs_logit_diff"] <= 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.export.json", "hf.result.json"]
    assert json.loads((tmp_path / "hf.export.json").read_text())["iteration"] == TRAIN_ITERS // 2


@pytest.mark.parametrize("flags, message", [
    (["--iteration", "5"], "iter_0000005 does not exist"),
    (["--tokenizer", "{empty}"], "no tokenizer files"),
    (["--bridge"], "--bridge needs --hf-model"),
])
def test_export_failures_name_the_cause_and_publish_nothing(trained, tmp_path, flags, message):
    (tmp_path / "empty").mkdir()
    flags = [f.format(empty=tmp_path / "empty") for f in flags]
    rc, result = run_export(tmp_path / "hf", "--checkpoint-root", str(trained.root), *flags)
    assert rc == 1 and not result["ok"]
    assert message in result["error"]
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_export_refuses_a_truncated_checkpoint(trained, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoints.checkpoint_dir(trained.root, TRAIN_ITERS),
                    checkpoints.checkpoint_dir(root, TRAIN_ITERS))
    checkpoints.write_tracker(root, TRAIN_ITERS)
    with open(checkpoints.checkpoint_dir(root, TRAIN_ITERS) / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    rc, result = run_export(tmp_path / "hf", "--checkpoint-root", str(root))
    assert rc == 1 and "model.safetensors has 100 bytes" in result["error"]


def test_heldout_perplexity_falls_with_training(exported, trained, tmp_path):
    output, _ = exported
    prompts = ["--prompt", "t5 t9", "--prompt", "t17", "--max-new-tokens", "6"]
    after = run_eval(output, trained, tmp_path / "after", *prompts)
    before = run_eval(trained.untrained, trained, tmp_path / "before")
    for result in (after, before):
        assert math.isfinite(result["perplexity"]) and math.isfinite(result["bits_per_byte"])
        assert result["bits_per_byte"] == pytest.approx(
            result["nll_per_token"] * result["tokens_evaluated"] / math.log(2)
            / result["bytes_evaluated"])
    assert before["perplexity"] == pytest.approx(256, rel=0.1)  # untrained: ~uniform over vocab
    assert after["perplexity"] < 0.5 * before["perplexity"]
    assert after["tokens_evaluated"] == before["tokens_evaluated"] > 0
    assert after["bytes_evaluated"] == sum(
        len(json.loads(line)["text"].encode()) for line in trained.heldout.read_text().split("\n")
        if line)
    assert [(s["prompt"], s["temperature"]) for s in after["samples"]] == [
        ("t5 t9", 0.0), ("t17", 0.0), ("t5 t9", 0.8), ("t17", 0.8)]
    for sample in after["samples"]:
        words = sample["completion"].split()
        assert 1 <= len(words) <= 6 and all(w.startswith("t") for w in words)


def test_windows_and_batches_do_not_change_what_is_counted(exported, trained, tmp_path):
    """Shorter windows (less context) score the same tokens and bytes; padding in a batch
    changes no log-probability."""
    from jobscripts.eval_hf import TransformersBackend

    output, _ = exported
    full = run_eval(output, trained, tmp_path / "full", "--max-tokens", "200")
    short = run_eval(output, trained, tmp_path / "short", "--max-tokens", "200",
                     "--max-model-len", "6")
    assert short["tokens_evaluated"] == full["tokens_evaluated"] == 200
    assert short["bytes_evaluated"] == full["bytes_evaluated"]
    assert short["documents_truncated"] == full["documents_truncated"]
    backend = TransformersBackend(str(output), batch_size=4)
    windows = [[0, 5, 9, 17], [0, 3], [0, 1, 2, 3, 4, 5, 6]]
    batched = backend.window_logprobs(windows)
    backend.batch_size = 1
    assert [len(w) for w in batched] == [3, 1, 6]
    for one, many in zip(backend.window_logprobs(windows), batched, strict=True):
        assert one == pytest.approx(many, abs=1e-5)


def test_evaluate_errors_name_file_and_line(exported, tmp_path):
    output, _ = exported
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "t1 t2"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    error = eval_error(output, tmp_path, "--data", str(data))
    assert error == f"{data}:2: no string field 'text'"


def test_bridge_path_calls_autobridge_as_convert_checkpoints_does(trained, tmp_path, monkeypatch):
    """Megatron Bridge is not installable here: a stand-in records the calls and writes what
    Bridge's config-only export writes (config + weights, no tokenizer, no generation config)."""
    import sys
    import types

    from transformers import AutoModelForCausalLM

    calls = []

    class FakeBridge:
        @classmethod
        def from_auto_config(cls, megatron_path, hf_model_id, trust_remote_code=False):
            calls.append(("from_auto_config", megatron_path, hf_model_id))
            return cls()

        def export_ckpt(self, megatron_path, hf_path, show_progress=True, strict=False,
                        source_path=None):
            calls.append(("export_ckpt", megatron_path, strict))
            AutoModelForCausalLM.from_pretrained(megatron_path).save_pretrained(hf_path)
            (Path(hf_path) / "generation_config.json").unlink()

    monkeypatch.setitem(sys.modules, "megatron.bridge",
                        types.SimpleNamespace(AutoBridge=FakeBridge))
    # The recipe's model id resolves to its snapshot in the HF cache ($HF_HOME), offline.
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    snapshot = cache / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (cache / "models--meta-llama--Llama-3.1-8B" / "refs").mkdir()
    (cache / "models--meta-llama--Llama-3.1-8B" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    rc, result = run_export(tmp_path / "hf", "--bridge", "--checkpoint-root", str(trained.root),
                            "--hf-model", "meta-llama/Llama-3.1-8B", "--tokenizer",
                            str(trained.tokenizer), "--iteration", str(TRAIN_ITERS // 2))
    assert rc == 0, result
    chosen = str(checkpoints.checkpoint_dir(trained.root, TRAIN_ITERS // 2))
    # Bridge gets the iter_* directory (it would pick the highest iter_* of a root itself).
    assert calls == [("from_auto_config", chosen, str(snapshot)),
                     ("export_ckpt", chosen, True)]
    assert result["mode"] == "bridge" and result["iteration"] == TRAIN_ITERS // 2
    assert {"tokenizer.json", "generation_config.json"} <= set(result["files"])
    assert "max_abs_logit_diff" not in result["verification"]  # no Megatron model on CPU here
    assert result["verification"]["tensors_checked"] > 0


def test_tensor_check_reads_headers_and_names_what_is_wrong(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from jobscripts.common import StepError
    from jobscripts.export_hf import check_tensors

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert check_tensors(tmp_path, config) > 0
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:8]
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StepError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"
                                        r".*model.norm.weight: \(8,\) != \(16,\)"):
        check_tensors(tmp_path, config)


def test_lm_eval_needs_a_vllm_backend(exported, trained, tmp_path):
    output, _ = exported
    error = eval_error(output, tmp_path, "--data", str(trained.heldout),
                       "--lm-eval-tasks", "mytask")
    assert "--lm-eval-tasks needs --backend vllm" in error


def dataset_documents(prefix: Path, indices) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in indices]


@pytest.mark.parametrize("split, name, split_range", [
    ("80,10,10", "test", [270, 300]),  # a test share: the test documents
    ("90,10,0", "valid", [270, 300]),  # none: the validation documents (as trained)
    ("80,15,5", "test", [285, 300]),
])
def test_evaluate_scores_the_heldout_split_of_the_dataset(exported, trained, tmp_path, split,
                                                          name, split_range):
    """Token ids come from the .bin/.idx (no text, no re-tokenization); bytes are those of
    their decoded text; the first documents of the split are taken."""
    from transformers import AutoTokenizer

    output, _ = exported
    result = run_eval(output, trained, tmp_path, "--max-documents", "4", "--split", split,
                      data=["--dataset", str(trained.dataset)])
    assert result["data"] is None
    assert result["heldout"] == {"split_weights": split, "split": name, "datasets": [{
        "prefix": str(trained.dataset), "split": name, "documents": 300,
        "split_range": split_range, "split_documents": split_range[1] - split_range[0],
        "evaluated_documents": 4, "evaluated_range": [split_range[0], split_range[0] + 4]}]}
    documents = dataset_documents(trained.dataset, range(split_range[0], split_range[0] + 4))
    assert all(d[-1] == 0 for d in documents)  # each ends in its EOD, which is not scored
    decode = AutoTokenizer.from_pretrained(output).decode
    assert result["documents_evaluated"] == 4
    assert result["tokens_evaluated"] == sum(len(d) - 1 for d in documents)
    assert result["bytes_evaluated"] == sum(len(decode(d[:-1]).encode()) for d in documents)
    assert math.isfinite(result["perplexity"])


def test_evaluate_takes_prefixes_from_the_manifest_and_checks_its_eod(exported, trained,
                                                                       tmp_path):
    from jobscripts import manifest as manifests

    output, _ = exported
    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{trained.dataset}{suffix}", data / f"corpus_text_document{suffix}")
    record = {"prefix": "corpus_text_document", "documents": 300, "tokens": 1, "text_bytes": 1,
              "bin_bytes": 1, "idx_sha256": "x"}
    settings = {"tokenizer_sha256": "x", "vocab_size": 256, "eod_id": 0, "dtype": "uint16",
                "legacy_tokenizer": False, "append_eod": True, "json_key": "text"}
    manifests.write(data / "manifest.json", manifests.build([record], settings))
    result = run_eval(output, trained, tmp_path / "ok", "--max-documents", "2",
                      data=["--manifest", str(data / "manifest.json")])
    assert result["heldout"]["datasets"][0]["prefix"] == str(data / "corpus_text_document")
    assert result["heldout"]["split"] == "valid"  # the default split "969,30,1" at 300 documents

    manifests.write(data / "manifest.json", manifests.build([record], {**settings, "eod_id": 3}))
    error = eval_error(output, tmp_path, "--manifest", str(data / "manifest.json"))
    assert "tokenized with EOD 3, the model's tokenizer has EOD 0" in error


def test_evaluate_refuses_a_split_that_holds_nothing_out(exported, trained, tmp_path):
    output, _ = exported
    error = eval_error(output, tmp_path, "--dataset", str(trained.dataset), "--split", "100,0,0")
    assert "leaves no test or valid documents among 300" in error
