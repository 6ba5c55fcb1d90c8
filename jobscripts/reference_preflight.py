"""Preflight of the CPU reference path: will this segment's run config run?

    python -m jobscripts.reference_preflight --config run.json [--result result.json]

The reference path's counterpart of jobscripts/bridge_preflight.py, in the same place of the
DAG (``train.preflight``), so every campaign has one task that decides "this config will run"
before a training job is queued. Checks (all this project's own: the trainer is too):
the run config as the trainer loads it (unknown keys, types, cross-field rules:
jobscripts/trainer_config.py), each data prefix's .bin/.idx, the tokenizer directory, and the
checkpoint directory (exists or can be created, writable).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from jobscripts.blend import missing_prefixes
from jobscripts.common import entry_point
from jobscripts.job_files import RESULT_FILE
from jobscripts.preflight_checks import Checks, tokenizer_problem, unwritable_dir
from jobscripts.trainer_config import load_config

RESULT_NAME = RESULT_FILE
BY = "reference"


def _pairs(data_path: list[str]) -> list[tuple[float, str]]:
    """Megatron's data_path (prefixes, or weight, prefix, ...) as (weight, prefix) pairs."""
    try:
        float(data_path[0])
    except (ValueError, IndexError):
        return [(1.0, p) for p in data_path]
    return [(float(w), p) for w, p in zip(data_path[::2], data_path[1::2], strict=True)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    checks = Checks()
    try:
        config = load_config(args.config)
    except (OSError, ValueError, TypeError) as exc:
        raise checks.failed("run config", BY, f"{args.config}: {exc}") from exc
    checks.passed("run config", BY, f"{args.config}: keys, types and cross-field rules")
    problems = [f"data_path: missing {p}.bin or {p}.idx"
                for p in missing_prefixes(_pairs(config.data_path))]
    problems += [p for p in [tokenizer_problem("tokenizer_model", config.tokenizer_model)] if p]
    why = unwritable_dir(config.save)
    if why:
        problems.append(f"save: {why}")
    if problems:
        raise checks.failed("paths", BY, "; ".join(problems))
    checks.passed("paths", BY, "data prefixes, tokenizer, checkpoint dir")
    return checks.result(config=str(Path(args.config)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobscripts.reference_preflight",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the segment's run config (run.json)")
    return parser


main = entry_point("reference_preflight", build_parser, run, RESULT_NAME, lambda args: ".")

if __name__ == "__main__":
    sys.exit(main())
