"""Build a small demo corpus, offline, from text that every machine with Python has.

Sources, in a seeded shuffle: docstrings of the standard library's modules, the
long descriptions (READMEs) of the installed packages, and plain-text files under
/usr/share/doc when the machine has them. The output mimics FineWeb's Parquet
layout (``text``, ``id``, ``url``, ``source``, ...) so the rest of the pipeline
cannot tell it from the real thing. The same seed and size give the same corpus
on the same machine; another Python or package set gives another corpus.

    python -m jobscripts.demo_corpus --output-dir DIR [--target-bytes 4000000]
        [--seed 0] [--shards 2] [--result PATH]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.metadata
import random
import sysconfig
import uuid
from functools import lru_cache
from pathlib import Path

from jobscripts.common import StepError, entry_point, log

MIN_DOC_CHARS = 200  # shorter snippets are mostly one-line docstrings: noise, not prose
MAX_DOC_CHARS = 60_000  # keeps one giant README from being a third of a small corpus
SKIP_STDLIB_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
DOC_NAMES = ("README", "NEWS", "copyright", "changelog")


@lru_cache(maxsize=1)  # the machine's files do not change while one process runs
def candidates() -> tuple[tuple[str, str], ...]:
    """Every (kind, location) that may yield a document, in a machine-stable order."""
    found: list[tuple[str, str]] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib.rglob("*.py"):
        if not SKIP_STDLIB_PARTS.intersection(path.relative_to(stdlib).parts):
            found.append(("stdlib", str(path)))
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.append(("package", name))
    share = Path("/usr/share/doc")
    if share.is_dir():
        for path in share.glob("*/*"):
            if path.is_file() and path.name.startswith(DOC_NAMES):
                found.append(("doc", str(path)))
    return tuple(sorted(set(found)))


def stdlib_text(path: Path) -> str:
    """A module's docstrings, headed by their qualified names, as one document."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = []
    if doc := ast.get_docstring(tree):
        parts.append(doc)
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if doc := ast.get_docstring(node):
                parts.append(f"{node.name}\n\n{doc}")
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and (doc := ast.get_docstring(sub)):
                        parts.append(f"{node.name}.{sub.name}\n\n{doc}")
    return "\n\n".join(parts)


def package_text(name: str) -> str:
    metadata = importlib.metadata.metadata(name)
    body = metadata.get_payload() or metadata.get("Description") or ""
    summary = metadata.get("Summary") or ""
    return f"{name}: {summary}\n\n{body}" if body.strip() else ""


def doc_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8")  # strict: a file that is not UTF-8 text is skipped


def extract(kind: str, where: str) -> tuple[str, str]:
    """(text, url) for one candidate; text is "" when it has nothing usable."""
    try:
        if kind == "stdlib":
            return stdlib_text(Path(where)), Path(where).as_uri()
        if kind == "package":
            return package_text(where), f"https://pypi.org/project/{where}/"
        return doc_text(Path(where)), Path(where).as_uri()
    except (
        OSError,
        SyntaxError,
        UnicodeDecodeError,
        ValueError,
        importlib.metadata.PackageNotFoundError,
    ):
        return "", ""


def clean(text: str) -> str:
    # Control characters other than tab/newline would trip the raw gate on purpose-built
    # data; the demo should pass it. Long texts are cut at a paragraph boundary.
    text = "".join(ch for ch in text if ch >= " " or ch in "\t\n").strip()
    if len(text) > MAX_DOC_CHARS:
        cut = text.rfind("\n\n", 0, MAX_DOC_CHARS)
        text = text[: cut if cut > MIN_DOC_CHARS else MAX_DOC_CHARS]
    return text


def select(target_bytes: int, seed: int) -> list[dict]:
    """Documents in seeded order until ``target_bytes`` of UTF-8 text is reached."""
    pool = list(candidates())
    random.Random(seed).shuffle(pool)  # noqa: S311 (a reproducible shuffle, not a secret)
    docs, seen, total = [], set(), 0
    for kind, where in pool:
        text, url = extract(kind, where)
        text = clean(text)
        digest = hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest()
        if len(text) < MIN_DOC_CHARS or digest in seen:
            continue
        seen.add(digest)
        docs.append(
            {
                "text": text,
                "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, f'{kind}:{where}')}>",
                "url": url,
                "source": kind,
                "dump": "demo",
                "date": "2024-01-01T00:00:00Z",
                "file_path": where,
                "language": "en",
            }
        )
        total += len(text.encode("utf-8"))
        if total >= target_bytes:
            break
    return docs


def write_shards(docs: list[dict], output_dir: Path, shards: int) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for index in range(shards):
        part = docs[index::shards]  # round-robin keeps shard sizes even
        path = output_dir / f"000_{index:05d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(pa.Table.from_pylist(part), tmp, row_group_size=1000)
        tmp.replace(path)
        written.append(
            {
                "file": path.name,
                "documents": len(part),
                "text_bytes": sum(len(d["text"].encode("utf-8")) for d in part),
            }
        )
        log(f"wrote {path} ({len(part)} documents)")
    return written


def build(args: argparse.Namespace) -> dict:
    if args.target_bytes <= 0 or args.shards <= 0:
        raise StepError("--target-bytes and --shards must be positive")
    docs = select(args.target_bytes, args.seed)
    if len(docs) < args.shards:
        raise StepError(f"found only {len(docs)} documents on this machine; need {args.shards}")
    total = sum(len(d["text"].encode("utf-8")) for d in docs)
    if total < args.target_bytes:
        log(f"warning: this machine only has {total} bytes of text, below --target-bytes")
    shards = write_shards(docs, Path(args.output_dir), args.shards)
    sources: dict[str, int] = {}
    for doc in docs:
        sources[doc["source"]] = sources.get(doc["source"], 0) + 1
    return {
        "output_dir": str(args.output_dir),
        "documents": len(docs),
        "text_bytes": total,
        "shards": shards,
        "sources": sources,
        "seed": args.seed,
        "target_bytes": args.target_bytes,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.demo_corpus", description=__doc__)
    p.add_argument("--output-dir", required=True, help="directory for the Parquet shards")
    p.add_argument("--target-bytes", type=int, default=4_000_000, help="UTF-8 text to collect")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed: same seed, same corpus")
    p.add_argument("--shards", type=int, default=2, help="number of Parquet files")
    return p


main = entry_point("demo_corpus", parser, build, "demo_corpus.json")


if __name__ == "__main__":
    raise SystemExit(main())
