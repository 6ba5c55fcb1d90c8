"""Helpers shared by the campaign tests: the example files and dotted-path edits."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

CAMPAIGNS = Path(__file__).resolve().parents[2] / "dags" / "campaigns"
DEMO = CAMPAIGNS / "demo.yaml"
LLAMA_8B = CAMPAIGNS / "llama31_8b_fp8.yaml"

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def raw(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_SAFE_LOADER)


def dump(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_SAFE_DUMPER, sort_keys=False)


def edited(doc: dict, changes: dict) -> dict:
    """A copy of ``doc`` with ``{"a.b[0].c": value}`` set; the value ``DELETE`` removes."""
    doc = copy.deepcopy(doc)
    for dotted, value in changes.items():
        parts = [int(i) if i else k for k, i in _PART.findall(dotted)]
        node = doc
        for part in parts[:-1]:
            node = node[part] if isinstance(part, int) else node.setdefault(part, {})
        if value is DELETE:
            del node[parts[-1]]
        else:
            node[parts[-1]] = value
    return doc


DELETE = object()
