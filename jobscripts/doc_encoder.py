"""Pick the fastest encoder that reproduces Megatron's ids, and encode batches with it.

Candidates, fastest first: tiktoken rebuilt from the tokenizer's vocabulary and
merges, HF ``tokenizers`` called directly, and Megatron's own tokenizer (the
reference, always right, 0.5 M tokens/s). A candidate is used only if, on a
sample of the real documents plus a set of awkward probe strings, it produces
exactly the ids ``preprocess_data``'s ``Encoder.encode`` would (EOD, empty
documents and sentence lists included).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jobscripts.common import StepError, log
from jobscripts.megatron_tokenizer import reference_document

PROBES = [
    "",
    " ",
    "Hello world",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n  \n",
    "contractions: I'm you're it's we'll they'd don't 'S 'LL",
    "digits 1234567890 3.14159 1e-9 ١٢٣",
    "Ünïcödé ÀÉÎÕÜ ß ﬁ 日本語のテキスト 한국어 Ελληνικά עברית العربية",
    "emoji 🎉👍🏽👨‍👩‍👧 and symbols ©®™ ∑∫√ → ← ★",
    "special <|endoftext|> inside<|endoftext|>text <|endoftext|><|endoftext|>",
    "<|pad|> <|begin_of_text|> <s> </s> <unk>",
    "\u00a0non-breaking\u2003em space\u200bzero width\ufeffbom",
    "replacement \ufffd and controls \x01\x7f\x85",
    "x" * 5000,
    "ab" * 3000 + " " * 100 + "\n" * 50,
]


@dataclass
class Encoder:
    """Content ids for one text, with Megatron's (legacy) BOS/EOS wrapping applied."""

    name: str
    encode: Callable[[str], np.ndarray]
    prefix: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)

    def text_ids(self, text: str) -> np.ndarray:
        ids = self.encode(text)
        if self.prefix or self.suffix:
            ids = np.concatenate([self.prefix, ids, self.suffix]).astype(np.int64)
        return ids


def utf8_bytes(text: str) -> int:
    # isascii() is O(1) on CPython's compact strings: most text skips the copy. Other text
    # is encoded anew, unless something asked the str for its UTF-8 before (tiktoken does,
    # and CPython keeps that copy): then encode() only copies it, ~35x cheaper.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def encode_batch(encoder: Encoder, texts: list, eod: int, dtype) -> tuple:
    """(tokens per document, all tokens concatenated, sentence lengths where not trivial,
    UTF-8 bytes of text).

    Runs on a worker thread: tiktoken and HF tokenizers release the GIL while they
    encode, so threads scale with no pickling between processes.
    """
    eod_array = np.array([eod], dtype=np.int64)
    parts: list[np.ndarray] = []
    text_bytes = 0
    counts = np.zeros(len(texts), dtype=np.int64)
    splits: dict[int, list[int]] = {}
    for i, text in enumerate(texts):
        sentences = text if isinstance(text, list) else (text,)
        lengths = []
        for sentence in sentences:
            ids = encoder.text_ids(sentence)
            text_bytes += utf8_bytes(sentence)  # after: tiktoken left the str its UTF-8 copy
            if len(ids):
                parts.append(ids)
                lengths.append(len(ids))
        if lengths:  # Megatron appends EOD only to a document with tokens
            parts.append(eod_array)
            lengths[-1] += 1
        counts[i] = sum(lengths)
        if len(lengths) > 1:
            splits[i] = lengths
    # Straight into the dataset's dtype: one pass over the batch, not a copy and a cast.
    tokens = np.concatenate(parts, dtype=dtype, casting="unsafe") if parts else np.zeros(0, dtype)
    return counts, tokens, splits, text_bytes


def _candidates(tokenizer_json: Path, reference, builders: dict) -> Iterator[tuple[str, Callable]]:
    """(name, encode) fastest first, each built only when the previous one failed."""
    from jobscripts.fast_encoder import HFEncoder, TiktokenEncoder, Unsupported, tiktoken_spec

    try:
        build = builders.get("tiktoken")
        encode = build() if build else TiktokenEncoder(tiktoken_spec(tokenizer_json)).encode
        yield "tiktoken", encode
    except Unsupported as exc:
        log(f"encoder: tiktoken cannot express this tokenizer ({exc})")
    yield "hf", HFEncoder(tokenizer_json).encode
    yield "reference", lambda text: np.asarray(reference.tokenize(text), dtype=np.int64)


def _wrapping(reference, encode: Callable, legacy: bool) -> tuple[list[int], list[int]]:
    """The ids the legacy tokenizer's post-processor puts around the content (e.g. BOS)."""
    if not legacy:
        return [], []
    probe = "wrapping probe"
    full, content = list(reference.tokenize(probe)), [int(i) for i in encode(probe)]
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return full[:start], full[start + len(content) :]
    return [], []  # not a wrapping: verification will reject this candidate


def choose(
    tokenizer_dir: Path,
    reference,
    sample: list,
    requested: str = "auto",
    legacy: bool = False,
    builders: dict[str, Callable[[], Callable]] | None = None,
) -> tuple[Encoder, dict]:
    """The first candidate whose document ids equal the reference's on sample + probes.

    ``builders`` maps a candidate's name to how the caller builds its encode function
    (called only when that candidate's turn comes, after the reference's ids are known:
    the forked check receives the caller's encoder spec only then).
    """
    started = time.monotonic()
    eod = reference.eod
    texts = PROBES + sample
    expected = [reference_document(reference, text) for text in texts]
    report = {"checked_texts": len(texts), "rejected": {}}
    for name, encode in _candidates(tokenizer_dir / "tokenizer.json", reference, builders or {}):
        if requested not in ("auto", name):
            continue
        prefix, suffix = _wrapping(reference, encode, legacy)
        encoder = Encoder(name, encode, prefix, suffix)
        for text, (ids, lengths) in zip(texts, expected, strict=True):
            counts, tokens, splits, _size = encode_batch(encoder, [text], eod, np.int64)
            got_lengths = splits.get(0) or ([int(counts[0])] if counts[0] else [])
            if tokens.tolist() != ids or got_lengths != lengths:
                report["rejected"][name] = f"differs from Megatron on {str(text)[:80]!r}"
                log(f"encoder: {name} rejected, {report['rejected'][name]}")
                break
        else:
            report["encoder"] = name
            report["seconds"] = round(time.monotonic() - started, 3)
            log(f"encoder: {name} gives Megatron's ids on {len(texts)} texts")
            return encoder, report
    raise StepError(f"no encoder reproduces Megatron's tokenizer: {report['rejected']}")
