"""What both preflights share: the list of checks made (and by whom), and path checks.

A preflight's result JSON (jobscripts/common.py contract) carries ``checks``: one entry per
check, ``by`` naming whose code made it, so a reader knows what "this config will run" rests on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jobscripts.common import StepError, log


class Checks:
    """The checks made so far; :meth:`failed` returns the StepError to raise."""

    def __init__(self, not_checked: tuple[str, ...] = ()) -> None:
        self.done: list[dict[str, Any]] = []
        self.not_checked = list(not_checked)

    def passed(self, name: str, by: str, detail: str = "") -> None:
        self.done.append({"check": name, "by": by, "ok": True, "detail": detail})
        log(f"preflight ok   [{by}] {name}{': ' + detail if detail else ''}")

    def failed(self, name: str, by: str, message: str) -> StepError:
        self.done.append({"check": name, "by": by, "ok": False, "detail": message})
        log(f"preflight FAIL [{by}] {name}: {message}")
        return StepError(message, {"checks": self.done, "failed_check": name,
                                   "not_checked": self.not_checked})

    def result(self, **extra: Any) -> dict[str, Any]:
        return {"checks": self.done, "not_checked": self.not_checked, **extra}


def unwritable_dir(path: str) -> str | None:
    """Why ``path`` cannot be a checkpoint directory (missing and not creatable, or not
    writable by this user), or None."""
    probe = Path(path)
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing parent of {path}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


def tokenizer_problem(key: str, path: object) -> str | None:
    """A Hugging Face tokenizer directory, as AutoTokenizer loads it."""
    if not isinstance(path, str):
        return None
    folder = Path(path)
    if not folder.is_dir():
        return f"{key}: no directory {path}"
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return f"{key}: {path} holds no tokenizer.json or tokenizer_config.json"
    return None
