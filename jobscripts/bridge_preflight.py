"""Megatron Bridge preflight: will this segment's configuration run? Decided before any GPU job.

    python -m jobscripts.bridge_preflight --recipe llama31_8b --config-file bridge.yaml \\
        --world-size 8 [--result result.json] [section.key=value ...]

Runs where the training runs, in the training image (production: the NeMo container on a CPU
node; locally: the Bridge venv), on the ``jobscripts`` the campaign shipped (PYTHONPATH), with
the same YAML and CLI overrides the segment will get. Nothing of this project needs to be
installed there. It writes its result JSON (jobscripts/common.py) with every check, who made it
(``bridge``: Bridge's or Megatron Core's own code; ``preflight``: this file), and the first
failure's message, which names the key at fault.

In order (a failure stops the rest; the result lists what did not run):
1. paths the YAML names (preflight): each data prefix's .bin/.idx, the tokenizer directory,
   the checkpoint directory (exists, or can be created, and is writable); HF_HUB_OFFLINE set;
2. the recipe by name (bridge), which reads the model's HF config from HF_HOME, offline;
3. the YAML, then the CLI overrides, through Bridge's override path (create_omegaconf_dict_config,
   OmegaConf merge, parse_hydra_overrides, apply_overrides) in STRICT mode: Bridge itself only
   warns and skips an unknown key; here it is an error naming the key (bridge);
4. the mixed-precision recipe by name (bridge: get_mixed_precision_config), and its FP8 recipe
   against Megatron Core's ``Fp8Recipe`` (preflight: neither Bridge nor Core checks it before
   the GPU job builds its TE recipe);
5. ``runtime_config_update`` for the job's world size (bridge): mixed precision applied to the
   model/optimizer/DDP configs, the data-parallel size (TP x PP x CP must divide the world
   size), ``ConfigContainer.validate()``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jobscripts.bridge_pretrain import (
    _load_tree,
    cli_tree,
    preflight,
    recipe_function_name,
    recipe_module,
)
from jobscripts.common import entry_point
from jobscripts.job_files import RESULT_FILE
from jobscripts.preflight_checks import Checks, tokenizer_problem, unwritable_dir

RESULT_NAME = RESULT_FILE
BY_BRIDGE, BY_PREFLIGHT = "bridge", "preflight"
# What a CPU node cannot check, said in every result (the GPU job is the first to see these).
NOT_CHECKED_ON_CPU = (
    "Transformer Engine kernels and FP8 support of the GPUs (the local venv imports a stand-in)",
    "model construction, parallel state and NCCL (pretrain() itself)",
)


def path_problems(tree: Mapping) -> list[str]:
    problems = preflight(tree)  # the segment's own checks: data prefixes, tokenizer dir exists
    tokenizer = (tree.get("tokenizer") or {}).get("tokenizer_model")
    if isinstance(tokenizer, str) and tokenizer.startswith("/") and Path(tokenizer).is_dir():
        problems += [p for p in [tokenizer_problem("tokenizer.tokenizer_model", tokenizer)] if p]
    for key in ("save", "load"):
        where = (tree.get("checkpoint") or {}).get(key)
        why = unwritable_dir(where) if isinstance(where, str) else None
        if why:
            problems.append(f"checkpoint.{key}: {why}")
    return problems


# --- 2.-5. Bridge's own code ----------------------------------------------------------------------
def build_recipe(recipe: str, checks: Checks) -> Any:
    name = f"model.recipe {recipe}"
    try:
        module = importlib.import_module(recipe_module(recipe))
    except ImportError as exc:
        raise checks.failed(name, BY_BRIDGE, f"importing {recipe_module(recipe)}: {exc}") from exc
    factory = getattr(module, recipe_function_name(recipe), None)
    if factory is None:
        raise checks.failed(name, BY_BRIDGE, f"{module.__name__} has no "
                                             f"{recipe_function_name(recipe)}")
    try:
        config = factory()
    except (OSError, ValueError) as exc:  # transformers' "not in the cache, offline" lands here
        raise checks.failed(name, BY_BRIDGE, (
            f"the recipe could not load its Hugging Face model config (HF_HOME="
            f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}, HF_HUB_OFFLINE="
            f"{os.environ.get('HF_HUB_OFFLINE', '')}): {type(exc).__name__}: {exc}")) from exc
    checks.passed(name, BY_BRIDGE, f"{factory.__name__}(), HF config from HF_HOME")
    return config


def apply_strict(config: Any, config_file: str, overrides: list[str], checks: Checks) -> None:
    """Bridge's process_config_with_overrides, step by step, with the OmegaConf tree in struct
    mode before the YAML is merged: an unknown key raises instead of being skipped."""
    from megatron.bridge.training.utils.omegaconf_utils import (
        OverridesError,
        apply_overrides,
        create_omegaconf_dict_config,
        parse_hydra_overrides,
    )
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    tree, excluded = create_omegaconf_dict_config(config)
    OmegaConf.set_struct(tree, True)
    try:
        tree = OmegaConf.merge(tree, OmegaConf.load(config_file))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise checks.failed(f"{config_file} keys", BY_BRIDGE, (
            f"{config_file}: {key}: {type(exc).__name__}: {getattr(exc, 'msg', exc)}")) from exc
    checks.passed(f"{config_file} keys", BY_BRIDGE, "strict OmegaConf merge onto the recipe")
    if overrides:
        try:
            tree = parse_hydra_overrides(tree, overrides)
        except OverridesError as exc:
            raise checks.failed("CLI overrides", BY_BRIDGE, str(exc)) from exc
        checks.passed("CLI overrides", BY_BRIDGE, " ".join(overrides))
    apply_overrides(config, OmegaConf.to_container(tree, resolve=True), excluded)


def resolve_precision(config: Any, checks: Checks) -> None:
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config
    from megatron.core.enums import Fp8Recipe

    given = config.mixed_precision
    if isinstance(given, str):
        try:
            config.mixed_precision = get_mixed_precision_config(given)
        except ValueError as exc:
            raise checks.failed("mixed_precision", BY_BRIDGE, f"mixed_precision: {exc}") from exc
        checks.passed("mixed_precision", BY_BRIDGE, given)
    precision = config.mixed_precision
    if precision is None or not getattr(precision, "fp8", None):
        return
    recipe = precision.fp8_recipe
    valid = [r.value for r in Fp8Recipe]
    if str(getattr(recipe, "value", recipe)) not in valid:
        raise checks.failed("mixed_precision.fp8_recipe", BY_PREFLIGHT, (
            f"mixed_precision.fp8_recipe: {recipe!r} is not a Megatron Core FP8 recipe "
            f"(one of {', '.join(valid)}); Bridge would only fail inside the GPU job"))
    checks.passed("mixed_precision.fp8_recipe", BY_PREFLIGHT, f"{recipe} (fp8={precision.fp8})")


def validate_for_world(config: Any, world_size: int, checks: Checks) -> None:
    from megatron.bridge.training.config import runtime_config_update

    os.environ["WORLD_SIZE"] = str(world_size)  # what Core's safe_get_world_size reads first
    if config.model.pipeline_model_parallel_size > 1 and config.model.pipeline_dtype is None:
        import torch  # bridge_pretrain.run sets it so too: YAML cannot give a torch.dtype

        config.model.pipeline_dtype = torch.bfloat16
    m = config.model
    layout = (f"TP x PP x CP = {m.tensor_model_parallel_size} x "
              f"{m.pipeline_model_parallel_size} x {m.context_parallel_size}")
    try:
        runtime_config_update(config)
    except (AssertionError, ValueError, TypeError) as exc:
        text = " ".join(str(exc).split())
        name = ("model.tensor_model_parallel_size x pipeline_model_parallel_size x "
                "context_parallel_size" if "total_model_size" in text else "ConfigContainer")
        raise checks.failed("validate", BY_BRIDGE, (
            f"{name}: Bridge's validation for world size {world_size} ({layout}) failed: "
            f"{type(exc).__name__}: {text}")) from exc
    checks.passed("validate", BY_BRIDGE, f"runtime_config_update + validate() for world size "
                                         f"{world_size}: {layout}, data-parallel "
                                         f"{config.data_parallel_size}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    checks = Checks(NOT_CHECKED_ON_CPU)
    overrides = list(args.overrides)
    try:
        tree = _load_tree(args.config_file)
        cli_tree(overrides)  # refuses + / ~ keys, which Bridge would add or delete silently
    except ValueError as exc:
        raise checks.failed("config file", BY_PREFLIGHT, str(exc)) from exc
    problems = path_problems(tree)
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        problems.append("HF_HUB_OFFLINE: not 1; the training job runs offline, so must this")
    if problems:
        raise checks.failed("paths", BY_PREFLIGHT, "; ".join(problems))
    checks.passed("paths", BY_PREFLIGHT, "data prefixes, tokenizer, checkpoint dir")
    config = build_recipe(args.recipe, checks)
    apply_strict(config, args.config_file, overrides, checks)
    resolve_precision(config, checks)
    validate_for_world(config, args.world_size, checks)
    return checks.result(recipe=args.recipe, world_size=args.world_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobscripts.bridge_preflight",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="e.g. llama31_8b")
    parser.add_argument("--config-file", required=True, help="the segment's Bridge YAML")
    parser.add_argument("--world-size", type=int, required=True, help="nodes x gpus_per_node")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as the segment gets")
    return parser


main = entry_point("bridge_preflight", build_parser, run, RESULT_NAME, lambda args: ".")

if __name__ == "__main__":
    sys.exit(main())
