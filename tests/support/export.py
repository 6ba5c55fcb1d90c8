"""The export job run in this process, and the length of the session's tiny training run
(tests/export_eval/conftest.py trains it; test modules compare against it)."""

from __future__ import annotations

import json
from pathlib import Path

TRAIN_ITERS = 24


def run_export(output: Path, *flags: str) -> tuple[int, dict]:
    from jobscripts.export_hf import main

    result = output.parent / f"{output.name}.result.json"
    rc = main(["--output", str(output), "--result", str(result), *flags])
    return rc, json.loads(result.read_text())
