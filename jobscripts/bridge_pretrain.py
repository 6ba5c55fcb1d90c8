"""Megatron Bridge pre-training, one segment: the production path's entrypoint.

    torchrun ... -m jobscripts.bridge_pretrain --recipe llama31_8b --config-file bridge.yaml
        [--segment-result segment.json] [--hf-offline] [section.key=value ...]

Runs inside the NeMo container on the GPU nodes; importable anywhere (Bridge is imported in
``main``). What it adds to Bridge's own ``02_pretrain_with_yaml.py`` tutorial (which always
builds Llama 3.2 1B):

- the recipe is picked by name: ``llama31_8b`` -> ``llama31_8b_pretrain_config`` from
  ``megatron.bridge.recipes.llama`` (or the family's package);
- every key of the YAML and of the CLI overrides must exist in the recipe's ConfigContainer
  (Bridge only logs a warning and trains without the setting); then the YAML and the
  overrides are applied by Bridge itself, so precedence is CLI > YAML > recipe, as there;
- paths in the YAML are checked before the minute-long Bridge import, and HF_HUB_OFFLINE is
  honoured (``--hf-offline`` sets it before huggingface_hub reads it at import);
- rank 0 writes ``segment.json`` in the reference trainer's shape (jobscripts/reference_trainer.py)
  also on failure, plus ``startup_seconds`` (job start -> ``pretrain()``, where Bridge's exit
  timer starts); its ``end_iteration`` is the last saved iteration;
- after each save, rank 0 applies the campaign's retention (``--keep-last``, ``--keep-every``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from jobscripts import checkpoints
from jobscripts.bridge_result import JOB_START_ENV, SegmentRecorder
from jobscripts.job_files import SEGMENT_RESULT
from jobscripts.results import write_json_atomic

# Recipe families whose package is imported alone (importing megatron.bridge.recipes pulls
# in every family, diffusion models included); any other name falls back to it.
_FAMILY_PACKAGES = ("llama", "qwen", "deepseek", "gemma", "glm", "gpt_oss", "nemotronh", "olmoe",
                    "moonlight", "ministral3", "kimi")

# Set to 1 (tests on a CPU cluster): stop once Bridge has built the config, before pretrain().
PREFLIGHT_ENV = "BRIDGE_CONFIG_ONLY"  # not PP_*: campaigns may not set those

FieldsOf = Callable[[Any], Mapping[str, Any] | None]


# --- recipe by name ---------------------------------------------------------------------------
def recipe_function_name(recipe: str) -> str:
    if not recipe.replace("_", "").isalnum() or not recipe[:1].isalpha():
        raise ValueError(f"recipe must be a name such as llama31_8b (got {recipe!r})")
    return f"{recipe}_pretrain_config"


def recipe_module(recipe: str) -> str:
    for family in sorted(_FAMILY_PACKAGES, key=len, reverse=True):
        if recipe.startswith(family):
            return f"megatron.bridge.recipes.{family}"
    return "megatron.bridge.recipes"


# --- refusing unknown keys (pure: the config tree is walked through ``fields_of``) -------------
def dataclass_fields(node: Any) -> Mapping[str, Any] | None:
    """The settable names of a config section -> current values; None for a plain value.

    Fields, plus properties with a setter (``dataset.seq_length`` is one): Bridge applies a
    key with ``setattr`` when ``hasattr`` says it exists.
    """
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return None
    names = [f.name for f in dataclasses.fields(node)]
    names += [n for n, p in inspect.getmembers(type(node), lambda m: isinstance(m, property))
              if p.fset is not None]
    return {n: getattr(node, n, None) for n in names}


def unknown_keys(tree: Mapping, node: Any, fields_of: FieldsOf, prefix: str = "") -> list[str]:
    """Problems with ``tree`` (a YAML override document) against the config ``node``."""
    known = fields_of(node)
    if known is None:
        return []
    problems = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=1)
            problems.append(f"{path}: unknown key" + (f" (did you mean {near[0]!r}?)" if near
                                                      else ""))
            continue
        child = known[key]
        if not isinstance(value, Mapping) or "_target_" in value:
            continue  # a value, or an object Bridge instantiates from _target_
        if fields_of(child) is not None:
            problems += unknown_keys(value, child, fields_of, path)
        elif child is None:
            problems.append(f"{path}: the recipe leaves this section unset (None), so its keys "
                            "cannot be checked or applied; give a _target_ or set it in Python")
        elif not isinstance(child, Mapping):
            problems.append(f"{path}: is a value ({type(child).__name__}), not a section")
    return problems


def cli_tree(overrides: list[str]) -> dict:
    """Hydra-style ``a.b=c`` overrides as a nested tree, for :func:`unknown_keys`."""
    tree: dict = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key.startswith(("~", "+")) and not key.startswith("++"):
            raise ValueError(f"override {item!r}: use section.key=value (adding or deleting "
                             "keys would be ignored by Bridge)")
        parts = key.removeprefix("++").split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return tree


def preflight(tree: Mapping) -> list[str]:
    """Paths the YAML names that must exist before 8 GPUs start: the tokenizer and data."""
    problems = []
    tokenizer = (tree.get("tokenizer") or {}).get("tokenizer_model")
    if isinstance(tokenizer, str) and tokenizer.startswith(("/", ".")) \
            and not Path(tokenizer).is_dir():
        problems.append(f"tokenizer.tokenizer_model: no directory {tokenizer}")
    data_path = (tree.get("dataset") or {}).get("data_path") or []
    for item in [data_path] if isinstance(data_path, str) else data_path:
        try:
            float(item)
            continue  # a blend weight
        except ValueError:
            pass
        for suffix in (".bin", ".idx"):
            if not Path(f"{item}{suffix}").is_file():
                problems.append(f"dataset.data_path: missing {item}{suffix}")
    return problems


# --- the run ------------------------------------------------------------------------------------
class ConfigProblem(ValueError):
    """The run must not start: a bad key, a missing path, an unknown recipe."""


def _section(tree: Mapping, name: str) -> Mapping:
    value = tree.get(name)
    return value if isinstance(value, Mapping) else {}


def _load_tree(path: str) -> Mapping:
    try:
        tree = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigProblem(f"{path}: {exc}") from exc
    if not isinstance(tree, Mapping):
        raise ConfigProblem(f"{path}: expected a mapping of sections")
    return tree


def run(args, overrides: list[str], tree: Mapping, recorder: SegmentRecorder) -> None:
    problems = preflight(tree)
    try:
        cli = cli_tree(overrides)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigProblem("; ".join(problems))
    module = importlib.import_module(recipe_module(args.recipe))  # minutes of CUDA imports
    factory = getattr(module, recipe_function_name(args.recipe), None)
    if factory is None:
        raise ConfigProblem(f"{module.__name__} has no {recipe_function_name(args.recipe)}")
    config = factory()
    problems = unknown_keys(tree, config, dataclass_fields)
    problems += [f"override {p}" for p in unknown_keys(cli, config, dataclass_fields)]
    if problems:
        raise ConfigProblem(f"{args.config_file}: " + "; ".join(problems))

    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    config = process_config_with_overrides(config, config_filepath=args.config_file,
                                           cli_overrides=overrides or None)
    if config.model.pipeline_model_parallel_size > 1 and config.model.pipeline_dtype is None:
        # Pipeline stages exchange activations in this dtype and Megatron requires it; YAML
        # cannot give one (a string does not become a torch.dtype where the recipe has None).
        import torch

        config.model.pipeline_dtype = torch.bfloat16
    recorder.configure(config.train.train_iters, config.model.seq_length, config.checkpoint.save)
    recorder.timer_started(os.environ.get(JOB_START_ENV))  # pretrain() is next
    if os.environ.get(PREFLIGHT_ENV) == "1":
        # The launch chain up to here (srun, container, torchrun, the YAML applied by Bridge)
        # without the GPU work: what a CPU-only cluster can run of a segment.
        recorder.result["preflight"] = {"config_built": True,
                                        "train_iters": config.train.train_iters,
                                        "world_size": os.environ.get("WORLD_SIZE")}
        print(f"bridge_pretrain: {PREFLIGHT_ENV}=1: config built, pretrain() not called",
              flush=True)
        return
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    manager = CallbackManager()
    for event in ("on_train_start", "on_train_step_end", "on_eval_end"):
        manager.register(event, getattr(recorder, event))
    manager.register("on_checkpoint_save", saved_callback(recorder, args))
    pretrain(config=config, forward_step_func=forward_step, callbacks=manager)


def saved_callback(recorder: SegmentRecorder, args) -> Callable[[Any], None]:
    """After each save: record it, then (rank 0 only, one deleter per job) apply the
    campaign's retention, which Bridge's ``most_recent_k`` cannot express (``keep_every``).
    The tracker's checkpoint and anything newer are never touched (checkpoints.py)."""
    rank_zero = os.environ.get("RANK", "0") == "0"

    def on_checkpoint_save(context) -> None:
        recorder.on_checkpoint_save(context)
        if rank_zero and recorder.save_dir and args.keep_last is not None:
            removed = checkpoints.apply_retention(recorder.save_dir, args.keep_last,
                                                  args.keep_every)
            if removed:
                print(f"bridge_pretrain: retention removed iterations {removed}", flush=True)

    return on_checkpoint_save


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jobscripts.bridge_pretrain",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="e.g. llama31_8b")
    parser.add_argument("--config-file", required=True, help="Bridge override YAML")
    parser.add_argument("--segment-result", default=SEGMENT_RESULT)
    parser.add_argument("--keep-last", type=int, default=None,
                        help="after each save keep the last N complete checkpoints")
    parser.add_argument("--keep-every", type=int, default=None,
                        help="and every checkpoint whose iteration is a multiple of M")
    parser.add_argument("--hf-offline", action="store_true",
                        help="no Hugging Face Hub access (also: HF_HUB_OFFLINE=1)")
    return parser.parse_known_args(argv)  # the rest: section.key=value overrides


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args, overrides = parse_args(argv)
    if args.hf_offline:  # before anything imports huggingface_hub, which reads it once
        os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    recorder = SegmentRecorder(started)
    rank_zero = os.environ.get("RANK", "0") == "0"  # one writer per job (shared run dir)

    def write() -> None:
        if rank_zero:
            write_json_atomic(args.segment_result, recorder.result)

    def on_signal(signum, frame) -> None:
        # torchrun kills the workers ~30 s after SIGTERM and Bridge (before v0.6.0) does not
        # save on it: report what the last checkpoint is, then die of the signal as asked.
        recorder.signal_name = signal.Signals(signum).name
        recorder.finish(None, None)
        write()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    code, error = 0, None
    try:
        tree = _load_tree(args.config_file)
        recorder.configure(_section(tree, "train").get("train_iters"),
                           _section(tree, "model").get("seq_length"),
                           _section(tree, "checkpoint").get("save"))
        run(args, overrides, tree, recorder)
    except SystemExit as exc:  # Bridge exits this way after exit_duration / exit_interval
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except ConfigProblem as exc:
        print(f"bridge_pretrain: {exc}", file=sys.stderr, flush=True)
        code, error = 2, f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        import traceback

        traceback.print_exc()
        code, error = 1, f"{type(exc).__name__}: {exc}"
    finally:
        for sig, handler in previous.items():  # as found: main() also runs in-process (tests)
            signal.signal(sig, handler)
        recorder.finish(code, error)
        write()
    return code


if __name__ == "__main__":
    sys.exit(main())
