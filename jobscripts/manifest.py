"""The dataset manifest: what a tokenized dataset is, so a campaign can pin it.

Tokenization writes ``manifest.json`` next to the ``.bin/.idx`` files, last.
The campaign stores it at segment 1; before every later segment the Airflow side
loads the current one and calls :func:`assert_same`, which refuses a dataset that
changed in any way that matters (tokenizer, ids, documents, bytes) and says how.
Volatile fields (paths, times, which encoder ran) are not compared.

Pure standard library: the Airflow side imports this module.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

FORMAT = "pretrain-pipeline/dataset-manifest/v1"
# What identifies the dataset. Everything else in the manifest is informative.
SETTINGS_KEYS = (
    "tokenizer_sha256",
    "vocab_size",
    "eod_id",
    "dtype",
    "legacy_tokenizer",
    "append_eod",
    "json_key",
)
PREFIX_KEYS = ("prefix", "documents", "tokens", "text_bytes", "bin_bytes", "idx_sha256")
TOTAL_KEYS = ("documents", "tokens", "text_bytes")


class ManifestError(ValueError):
    """A manifest is unreadable, malformed, or differs from the pinned one."""


def _entry(record: dict) -> dict:
    entry = {key: record[key] for key in PREFIX_KEYS}
    if "bin_sha256" in record:
        entry["bin_sha256"] = record["bin_sha256"]
    entry["source"] = record.get("input")
    return entry


def fingerprint(manifest: dict) -> str:
    """sha256 over the identifying fields only, in a canonical JSON form."""
    core = {
        "settings": {k: manifest["settings"][k] for k in SETTINGS_KEYS},
        "prefixes": [{k: p[k] for k in PREFIX_KEYS} for p in manifest["prefixes"]],
    }
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def build(records: list[dict], settings: dict, shards: list[dict] | None = None) -> dict:
    """Manifest from the done-records of the dataset's prefixes (and its shards if merged)."""
    prefixes = [_entry(r) for r in records]
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": {k: settings[k] for k in SETTINGS_KEYS},
        "prefixes": prefixes,
        "total": {k: sum(p[k] for p in prefixes) for k in TOTAL_KEYS},
    }
    if shards is not None:
        manifest["shards"] = [_entry(r) for r in shards]
    manifest["fingerprint"] = fingerprint(manifest)
    return manifest


def write(path: str | Path, manifest: dict) -> Path:
    from jobscripts.results import write_json_atomic

    return write_json_atomic(path, manifest)


def load(path: str | Path) -> dict:
    """Read and validate a manifest; ManifestError names the file and the missing field."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"{path}: not a {FORMAT} manifest")
    for key in ("settings", "prefixes", "total", "fingerprint"):
        if key not in manifest:
            raise ManifestError(f"{path}: field {key!r} is missing")
    for key in SETTINGS_KEYS:
        if key not in manifest["settings"]:
            raise ManifestError(f"{path}: field settings.{key} is missing")
    for i, entry in enumerate(manifest["prefixes"]):
        for key in PREFIX_KEYS:
            if key not in entry:
                raise ManifestError(f"{path}: field prefixes[{i}].{key} is missing")
    if fingerprint(manifest) != manifest["fingerprint"]:
        raise ManifestError(f"{path}: fingerprint does not match its contents (edited by hand?)")
    return manifest


def diff(pinned: dict, current: dict) -> list[str]:
    """Human-readable differences that matter; empty when the datasets are the same."""
    lines = []
    for key in SETTINGS_KEYS:
        old, new = pinned["settings"].get(key), current["settings"].get(key)
        if old != new:
            lines.append(f"settings.{key}: pinned {old!r}, now {new!r}")
    old_prefixes = {p["prefix"]: p for p in pinned["prefixes"]}
    new_prefixes = {p["prefix"]: p for p in current["prefixes"]}
    for name in sorted(old_prefixes.keys() - new_prefixes.keys()):
        lines.append(f"prefix {name}: in the pinned manifest, missing now")
    for name in sorted(new_prefixes.keys() - old_prefixes.keys()):
        lines.append(f"prefix {name}: new, not in the pinned manifest")
    for name in sorted(old_prefixes.keys() & new_prefixes.keys()):
        for key in PREFIX_KEYS[1:]:
            old, new = old_prefixes[name].get(key), new_prefixes[name].get(key)
            if old != new:
                lines.append(f"prefix {name}: {key} pinned {old!r}, now {new!r}")
    if not lines and [p["prefix"] for p in pinned["prefixes"]] != [
        p["prefix"] for p in current["prefixes"]
    ]:
        lines.append("prefixes: same set, different order")
    return lines


def assert_same(pinned: dict, current: dict, where: str = "dataset") -> None:
    """Raise ManifestError listing every difference when ``current`` is not ``pinned``."""
    changes = diff(pinned, current)
    if changes:
        raise ManifestError(
            f"{where} changed since it was pinned (fingerprint {pinned['fingerprint'][:12]} -> "
            f"{current['fingerprint'][:12]}): " + "; ".join(changes)
        )


def data_prefixes(manifest: dict, base_dir: str | Path) -> list[str]:
    """Absolute prefixes for Megatron's --data-path, in manifest order."""
    return [str(Path(base_dir) / p["prefix"]) for p in manifest["prefixes"]]
