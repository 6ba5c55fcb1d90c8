"""Dataset blends: validate ``[(weight, prefix), ...]`` and render Megatron's flat list.

    python -m jobscripts.blend --blend 30 /data/a_text_document --blend 70 /data/b_text_document
        [--output-dir DIR] [--result PATH]

Megatron takes ``--data-path 30 prefixA 70 prefixB`` (weights are normalised by
Megatron). The pure functions are imported by the Airflow side to validate a
campaign config; the entry point checks on the cluster that every prefix has its
``.bin`` and ``.idx``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable, Sequence

from jobscripts.common import StepError, entry_point


class BlendError(ValueError):
    """The blend is malformed; the message names the entry at fault."""


def _weight(value, index: int) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError) as exc:
        raise BlendError(f"blend[{index}]: weight {value!r} is not a number") from exc
    if not math.isfinite(weight) or weight <= 0:
        raise BlendError(f"blend[{index}]: weight {value!r} must be positive and finite")
    return weight


def validate(entries: Iterable) -> list[tuple[float, str]]:
    """Accept (weight, prefix) pairs or {"weight", "prefix"} dicts; return clean pairs."""
    clean: list[tuple[float, str]] = []
    for index, entry in enumerate(entries):
        if isinstance(entry, dict):
            missing = {"weight", "prefix"} - entry.keys()
            if missing:
                raise BlendError(f"blend[{index}]: missing {sorted(missing)}")
            weight, prefix = entry["weight"], entry["prefix"]
        elif isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2:
            weight, prefix = entry
        else:
            raise BlendError(f"blend[{index}]: expected (weight, prefix), got {entry!r}")
        if not isinstance(prefix, str) or not prefix.strip() or any(c.isspace() for c in prefix):
            raise BlendError(
                f"blend[{index}]: prefix {prefix!r} must be a non-empty path without spaces"
            )
        if prefix.endswith((".bin", ".idx")):
            raise BlendError(f"blend[{index}]: prefix {prefix!r} must not include .bin/.idx")
        clean.append((_weight(weight, index), prefix))
    if not clean:
        raise BlendError("blend is empty")
    seen = [p for _w, p in clean]
    if len(set(seen)) != len(seen):
        raise BlendError(
            f"blend lists a prefix twice: {sorted({p for p in seen if seen.count(p) > 1})}"
        )
    return clean


def format_weight(weight: float) -> str:
    """'30' for 30.0, shortest round-trip repr otherwise: Megatron parses it with float()."""
    return str(int(weight)) if weight.is_integer() else repr(weight)


def render(entries: Iterable) -> list[str]:
    """Megatron's flat ``["30", "prefixA", "70", "prefixB"]`` form."""
    flat: list[str] = []
    for weight, prefix in validate(entries):
        flat += [format_weight(weight), prefix]
    return flat


def normalized(entries: Iterable) -> list[tuple[float, str]]:
    pairs = validate(entries)
    total = sum(w for w, _p in pairs)
    return [(w / total, p) for w, p in pairs]


def missing_prefixes(
    entries: Iterable, exists: Callable[[str], bool] = os.path.exists
) -> list[str]:
    """Prefixes whose .bin or .idx is absent; ``exists`` may check over SFTP instead."""
    return [p for _w, p in validate(entries) if not (exists(p + ".bin") and exists(p + ".idx"))]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.blend", description=__doc__)
    p.add_argument("--blend", nargs=2, action="append", metavar=("WEIGHT", "PREFIX"), required=True)
    p.add_argument("--output-dir", default=".", help="where the result JSON goes")
    return p


def check(args: argparse.Namespace) -> dict:
    try:
        flat = render(args.blend)
        missing = missing_prefixes(args.blend)
    except BlendError as exc:
        raise StepError(str(exc)) from exc
    if missing:
        raise StepError(f"prefixes without .bin/.idx on this cluster: {missing}")
    return {"data_path": flat, "normalized": [[w, p] for w, p in normalized(args.blend)]}


main = entry_point("blend", parser, check, "blend.json")


if __name__ == "__main__":
    raise SystemExit(main())
