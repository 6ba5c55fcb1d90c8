"""Line-level scan of JSONL shards: the faults great-expectations cannot see.

GX validates a DataFrame, so a line that is not UTF-8, not JSON, or not an
object never reaches it. This scan reads every line as bytes, reports such lines
by file and line number, and draws a deterministic reservoir sample of the good
ones, reduced to the per-document features the gate checks (lengths, hash,
character shares): the texts themselves are never held, so memory stays small
even for a full scan.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from jobscripts.doc_stream import iter_raw_lines
from jobscripts.fast_json import loads

# Characters a text corpus should not contain: C0/C1 controls other than tab, LF and CR,
# surrogates, private-use code points and the noncharacters. Unassigned code points are
# left out on purpose: they depend on this Python's Unicode version.
NONPRINTABLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ue000-\uf8ff\ufdd0-\ufdef\ufffe\uffff"
    "\U000f0000-\U0010ffff]"
)
REPLACEMENT = "\ufffd"
# What a file that is not UTF-8 text usually is, by its first bytes.
MAGIC = ((b"\xff\xfe", "UTF-16 text (little-endian byte order mark)"),
         (b"\xfe\xff", "UTF-16 text (big-endian byte order mark)"),
         (b"\x1f\x8b", "gzip-compressed"), (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
         (b"BZh", "bzip2-compressed"), (b"PAR1", "a Parquet file"))


@dataclass
class Issue:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:  # line 0: the whole file
        return f"{self.file}:{self.line}: {self.reason}" if self.line else \
            f"{self.file}: {self.reason}"


@dataclass
class ScanResult:
    files: list[str]
    lines: int = 0
    issue_count: int = 0
    issues: list[Issue] = field(default_factory=list)  # the first max_issues of them
    # One per file none of whose lines is good (not UTF-8 at all, compressed, binary): said
    # once, first, instead of being buried among thousands of line issues.
    file_issues: list[Issue] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # feature rows of the sampled documents


def features(file: str, line: int, record: dict, text_key: str, id_key: str) -> dict:
    """One DataFrame row: everything the expectations need, without the text."""
    text = record.get(text_key)
    doc_id = record.get(id_key)
    row = {"file": file, "line": line, "id": None if doc_id is None else str(doc_id)}
    if not isinstance(text, str):
        return {
            **row,
            "text_chars": None,
            "text_sha1": None,
            "replacement_share": None,
            "nonprintable_share": None,
        }
    chars = len(text)
    return {
        **row,
        "text_chars": chars,
        "text_sha1": hashlib.sha1(
            text.encode("utf-8", "surrogatepass"), usedforsecurity=False
        ).hexdigest(),
        "replacement_share": text.count(REPLACEMENT) / chars if chars else 0.0,
        "nonprintable_share": len(NONPRINTABLE.findall(text)) / chars if chars else 0.0,
    }


def sniff(path: Path) -> str:
    """A guess at what a file is, from its first bytes, for an error message."""
    with open(path, "rb") as handle:
        head = handle.read(8)
    for magic, what in MAGIC:
        if head.startswith(magic):
            return what
    if b"\x00" in head:
        return "binary, or UTF-16/32 without a byte order mark (NUL bytes)"
    return f"text starting {head!r}"


def check_line(raw: bytes, text_key: str) -> tuple[dict | None, str | None]:
    """(record, None) for a good line, (None, reason) for a bad one."""
    if not raw.strip():
        return None, "blank line (not a JSON object)"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (
            None,
            f"invalid UTF-8 at byte {exc.start} of the line ({raw[exc.start : exc.start + 4]!r})",
        )
    try:
        record = loads(raw)
    except ValueError as exc:
        try:  # orjson rejects lone surrogate escapes; json accepts them. Which is it?
            json.loads(raw)
        except ValueError:
            return None, f"malformed JSON: {exc}"
        return None, "lone surrogate escape (\\ud800-\\udfff): not encodable text"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    text = record.get(text_key)
    if text is not None and not isinstance(text, str):
        return None, f"field {text_key!r} is a {type(text).__name__}, not a string"
    return record, None


def scan(
    paths: list[Path],
    sample_size: int,
    seed: int,
    full: bool = False,
    text_key: str = "text",
    id_key: str = "id",
    max_issues: int = 50,
) -> ScanResult:
    """Scan every line of every file; sample ``sample_size`` good lines (all when ``full``)."""
    rng = random.Random(seed)  # noqa: S311 (a reproducible sample, not a secret)
    result = ScanResult(files=[str(p) for p in paths])
    seen = 0  # good lines so far: the reservoir's population
    for path in paths:
        good = bad = 0
        for number, (raw, _offset) in enumerate(iter_raw_lines(path), start=1):
            result.lines += 1
            record, reason = check_line(raw, text_key)
            if reason is not None:
                bad += 1
                result.issue_count += 1
                if len(result.issues) < max_issues:
                    result.issues.append(Issue(path.name, number, reason))
                continue
            good += 1
            seen += 1
            if full or len(result.rows) < sample_size:
                result.rows.append(features(path.name, number, record, text_key, id_key))
            elif (slot := rng.randrange(seen)) < sample_size:
                result.rows[slot] = features(path.name, number, record, text_key, id_key)
        if bad and not good:
            result.file_issues.append(Issue(path.name, 0, (
                f"not UTF-8 JSONL at all: none of its {bad} lines is a JSON object in UTF-8; "
                f"it looks like {sniff(path)}")))
    if not full:
        result.rows.sort(key=lambda row: (row["file"], row["line"]))
    return result
