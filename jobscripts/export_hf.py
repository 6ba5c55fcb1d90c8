"""Export a training checkpoint to a Hugging Face directory, verified, then published atomically.

    python -m jobscripts.export_hf --checkpoint-root ROOT --output HF_DIR [--iteration N]
        [--tokenizer DIR] [--atol 1e-5] [--result PATH]
    python -m jobscripts.export_hf --bridge --checkpoint-root ROOT --hf-model REF
        --output HF_DIR --tokenizer DIR [--iteration N] [--not-strict] [--result PATH]

Reference path (default): a reference-trainer checkpoint (``iter_XXXXXXX/`` holding HF weights)
is loaded with transformers and saved with ``save_pretrained``. Production path (``--bridge``,
inside the NeMo container, on CPU): Megatron Bridge's ``AutoBridge``, as its
``examples/conversion/convert_checkpoints.py export`` does: ``from_auto_config(checkpoint,
REF)`` synthesizes the HF config from the checkpoint's ``run_config.yaml`` and the reference
HF config (model id or local directory), then ``export_ckpt`` writes config and safetensors.

Both paths:
- export one iteration: ``--iteration N``, else the latest complete one by the tracker contract
  (jobscripts/checkpoints.py). Bridge itself would take the highest ``iter_*`` directory, even
  an unfinished one, so it is always handed the chosen ``iter_*`` directory, never the root;
- copy the tokenizer files beside ``config.json`` (Bridge writes none) and write
  ``generation_config.json`` when the export has none (vLLM reads EOS from it);
- verify before publishing: transformers loads the config and the tokenizer, the tokenizer
  fits the vocabulary, every tensor the architecture needs is in the safetensors with its
  shape (read from the headers: no 16 GB load); on the reference path also a CPU forward
  pass of the exported model gives the checkpoint's logits on a fixed input (``--atol``);
- build in a temp directory beside ``--output`` and rename it into place, so a reader sees
  the old export or the new one, never half of one;
- then write ``<output>.export.json`` beside it, whatever ``--result`` says: the listing
  (file names and sizes) that registration fetches over SFTP and checks what it got against
  (operators/campaign/adapters/export_fetch.py). Its ``iteration`` and ``files`` describe the
  directory published just before it; a crash in between leaves sizes that no longer match, which
  registration refuses.

Result JSON (default: the listing, <output>.export.json): ok, error, mode, output, iteration,
checkpoint, fallback_reason, files {name: bytes}, total_bytes, verification {config_class,
vocab_size, tokenizer_size, tensors_checked, max_abs_logit_diff, atol, input_tokens}, step,
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from jobscripts import checkpoints
from jobscripts.common import StepError, entry_point, log
from jobscripts.results import write_json_atomic

# Everything AutoTokenizer may need from a tokenizer directory; absent ones are skipped.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "chat_template.jinja")
_STAGING_PREFIX = ".tmp-"
LISTING_SUFFIX = ".export.json"  # <output><suffix>: the published export's listing


def listing_path(output: str | Path) -> Path:
    return Path(f"{Path(output)}{LISTING_SUFFIX}")


def select_checkpoint(root: Path, iteration: int | None) -> checkpoints.ResumePoint:
    if iteration is not None:
        path = checkpoints.checkpoint_dir(root, iteration)
        problem = checkpoints.check_complete(path)
        if problem:
            raise StepError(f"--iteration {iteration}: {root}/{problem}")
        return checkpoints.ResumePoint(iteration, path)
    try:
        point = checkpoints.find_resume_checkpoint(root)
    except RuntimeError as exc:
        raise StepError(str(exc)) from exc
    if point is None:
        raise StepError(f"--checkpoint-root {root}: no checkpoint to export")
    if point.fallback_reason:
        log(f"WARNING: {point.fallback_reason}")
    return point


def export_reference(checkpoint: Path, staging: Path):
    """Load the reference checkpoint and save it in HF layout; returns the loaded model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.eval()
    model.save_pretrained(staging)
    return model


def resolve_hf_model(ref: str) -> str:
    """``--hf-model`` as a local directory holding the model's ``config.json``: a directory as
    given, or a model id (``meta-llama/Meta-Llama-3.1-8B``, the recipe's) looked up in the
    Hugging Face cache under ``$HF_HOME``, offline. A tokenizer folder has no config.json,
    and compute nodes have no Hub: either fails here, naming what is missing."""
    from huggingface_hub import constants, try_to_load_from_cache

    if Path(ref).is_dir():
        if not (Path(ref) / "config.json").is_file():
            raise StepError(f"--hf-model {ref}: no config.json there (a tokenizer folder is "
                            "not a model reference)")
        return ref
    cached = try_to_load_from_cache(ref, "config.json")
    if not isinstance(cached, str):
        raise StepError(
            f"--hf-model {ref}: its config.json is not in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (HF_HOME={os.environ.get('HF_HOME', 'unset')}); put it "
            f"there once where the Hub is reachable: hf download {ref} config.json")
    return str(Path(cached).parent)


def export_bridge(checkpoint: Path, staging: Path, hf_model: str, strict: bool) -> None:
    """Megatron Bridge export of one ``iter_*`` directory (CPU, gloo, inside export_ckpt)."""
    from megatron.bridge import AutoBridge

    if hasattr(AutoBridge, "from_auto_config"):  # 26.04: config from run_config.yaml + REF
        bridge = AutoBridge.from_auto_config(str(checkpoint), hf_model)
    else:  # older releases: the reference model's own config
        bridge = AutoBridge.from_hf_pretrained(hf_model)
    bridge.export_ckpt(megatron_path=str(checkpoint), hf_path=str(staging),
                       show_progress=False, strict=strict)


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not copied:
        raise StepError(f"{source}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
                        "pass --tokenizer DIR")
    for name in copied:
        shutil.copy2(source / name, target / name)
    return copied


def ensure_generation_config(directory: Path) -> None:
    if (directory / "generation_config.json").is_file():
        return
    from transformers import AutoConfig, GenerationConfig

    GenerationConfig.from_model_config(AutoConfig.from_pretrained(directory)).save_pretrained(
        directory)


def check_tensors(directory: Path, config) -> int:
    """Every tensor the architecture has is in the safetensors with its shape; returns the count.

    The model is built on the meta device (no memory) and the files are read by header only.
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape)
                    for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    found: dict[str, tuple[int, ...]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                found[key] = tuple(handle.get_slice(key).get_shape())
    if getattr(config, "tie_word_embeddings", False):
        # Tied: transformers stores it once, as the embedding; other writers may store both.
        expected.pop("lm_head.weight", None)
        found.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or unexpected or wrong:
        details = [f"{k}: {found[k]} != {expected[k]}" for k in wrong[:3]]
        raise StepError(f"{directory.name}: safetensors do not match {type(config).__name__}: "
                        f"missing {missing[:5]}, unexpected {unexpected[:5]}, shapes {details}")
    return len(found)


def compare_logits(model, directory: Path, atol: float) -> dict:
    """Logits of the exported model against the checkpoint's on a fixed token sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    length = min(32, getattr(config, "max_position_embeddings", 32) or 32)
    ids = (torch.arange(length) * 7919 + 13).remainder(config.vocab_size).unsqueeze(0)
    exported = AutoModelForCausalLM.from_pretrained(directory)
    exported.eval()
    with torch.no_grad():
        diff = (model(input_ids=ids).logits.float()
                - exported(input_ids=ids).logits.float()).abs().max().item()
    if not diff <= atol:  # also catches NaN
        raise StepError(f"exported logits differ from the checkpoint's by {diff:.3g} > {atol:g}")
    return {"max_abs_logit_diff": diff, "atol": atol, "input_tokens": length}


def verify(directory: Path, model=None, atol: float = 1e-5) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise StepError(f"transformers cannot load the export: {exc}") from exc
    if len(tokenizer) > config.vocab_size:
        raise StepError(f"tokenizer has {len(tokenizer)} tokens, config.json vocab_size "
                        f"{config.vocab_size}: ids past the embedding would crash serving")
    result = {"config_class": type(config).__name__, "vocab_size": config.vocab_size,
              "tokenizer_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
              "tensors_checked": check_tensors(directory, config)}
    if model is not None:
        result.update(compare_logits(model, directory, atol))
    return result


def publish(staging: Path, output: Path) -> None:
    """Rename the finished export into place; an older export is moved aside, then removed."""
    old = None
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}old-{output.name}.",
                                    dir=output.parent))
        os.replace(output, old / output.name)
    os.replace(staging, output)
    fd = os.open(output.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(args: argparse.Namespace) -> dict:
    root, output = Path(args.checkpoint_root), Path(args.output)
    if args.bridge and not args.hf_model:
        raise StepError("--bridge needs --hf-model (the reference HF config: model id or dir)")
    point = select_checkpoint(root, args.iteration)
    log(f"exporting {point.path} -> {output} ({'bridge' if args.bridge else 'reference'})")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{output.name}.", dir=output.parent))
    try:
        model = None
        if args.bridge:
            reference = resolve_hf_model(args.hf_model)
            log(f"reference HF config for {args.hf_model}: {reference}")
            export_bridge(point.path, staging, reference, strict=not args.not_strict)
            tokenizer_source = Path(args.tokenizer or args.hf_model)
        else:
            model = export_reference(point.path, staging)
            tokenizer_source = Path(args.tokenizer) if args.tokenizer else point.path
        copied = copy_tokenizer(tokenizer_source, staging)
        ensure_generation_config(staging)
        log(f"copied tokenizer files {copied} from {tokenizer_source}; verifying")
        verification = verify(staging, model, args.atol)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
    log(f"exported iteration {point.iteration}: {sum(files.values())} bytes in {len(files)} "
        f"files; {json.dumps(verification)}")
    result = {"mode": "bridge" if args.bridge else "reference", "output": str(output),
              "iteration": point.iteration, "checkpoint": str(point.path),
              "fallback_reason": point.fallback_reason, "files": files,
              "total_bytes": sum(files.values()), "verification": verification}
    write_json_atomic(listing_path(output), {**result, "ok": True})
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.export_hf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-root", required=True, help="directory holding iter_* + tracker")
    p.add_argument("--output", required=True, help="the Hugging Face directory to write")
    p.add_argument("--iteration", type=int, help="default: latest complete checkpoint")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's files "
                                       "on the reference path, --hf-model with --bridge)")
    p.add_argument("--atol", type=float, default=1e-5, help="logit tolerance (reference path)")
    p.add_argument("--bridge", action="store_true", help="Megatron Bridge checkpoint (NeMo)")
    p.add_argument("--hf-model", help="--bridge: the recipe's HF model id (from the cache "
                                      "under $HF_HOME) or a directory with its config.json")
    p.add_argument("--not-strict", action="store_true",
                   help="--bridge: allow checkpoint and HF keys to differ")
    return p


# The default result is the listing itself, beside the export, never inside it (publishing
# replaces the directory); entry_point joins result_dir and result_name, so the whole path goes
# in the first.
main = entry_point("export_hf", build_parser, export, "",
                   result_dir=lambda args: str(listing_path(args.output)))

if __name__ == "__main__":
    raise SystemExit(main())
