"""Encoders that give the same ids as the HF tokenizer, only faster.

Megatron's ``preprocess_data`` encodes through HF ``tokenizers`` one document at a
time (0.5 M tokens/s here). A byte-level BPE (GPT-2, Llama 3, the BPE that
``train_tokenizer`` writes) can be re-expressed as a ``tiktoken.Encoding``: the
same pre-tokenizer regex, mergeable ranks from the merge order, the added tokens
as tiktoken specials. tiktoken's merge loop is 6x faster. The two algorithms are
not equivalent for every possible merge table, so ``tokenize_megatron`` checks
the ids against Megatron's own tokenizer on a sample before trusting this, and
falls back to HF ``tokenizers`` otherwise.

This module is imported by worker processes: numpy, tiktoken and tokenizers only.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

import numpy as np

from jobscripts.fast_json import loads

# HF's ByteLevel pre-tokenizer with use_regex=True splits with exactly this pattern.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Unsupported(ValueError):
    """The tokenizer cannot be expressed as a tiktoken Encoding."""


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def _latin1_table() -> dict[int, int]:
    """str.translate table: stand-in char -> the char whose code is its byte.

    Characters below 256 that are not stand-ins map to U+FFFF so that encoding to
    Latin-1 fails on them, as it does on anything else outside the alphabet.
    """
    table = {code: 0xFFFF for code in range(256)}
    table.update({ord(char): byte for char, byte in byte_decoder().items()})
    return table


def _token_bytes(token: str) -> bytes:
    try:
        return token.translate(_latin1_table()).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise Unsupported(f"token {token!r} is not in the byte-level alphabet") from exc


def _tokens_bytes(tokens: list[str]) -> list[bytes]:
    """The bytes of each token. One translate and one encode over all of them, then slices,
    all in C: each stand-in character is one byte, so a token's byte length is its length.
    (The tiktoken spec is built before encoding can start; one call per token, 50k of
    them, cost twice as much.)"""
    try:
        joined = "".join(tokens).translate(_latin1_table()).encode("latin-1")
    except UnicodeEncodeError:
        for token in tokens:
            _token_bytes(token)  # raises, naming the first token outside the alphabet
        raise
    ends = list(accumulate(map(len, tokens)))
    return list(map(joined.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def _merge_results(merges: list, vocab: dict[str, int]) -> tuple[list[str], list[int]]:
    """(the token each merge makes, its id), in merge order; merges are ``"a b"`` strings
    or ``[a, b]`` pairs."""
    pairs = [merge.split(" ") if isinstance(merge, str) else merge for merge in merges]
    try:
        merged = [left + right for left, right in pairs]
    except (ValueError, TypeError):
        merged = []  # a merge that is not a pair: named below
    ids = list(map(vocab.get, merged))
    if len(merged) != len(merges) or None in ids:
        for merge, pair in zip(merges, pairs, strict=True):
            if len(pair) != 2 or pair[0] + pair[1] not in vocab:
                raise Unsupported(f"merge {merge!r} is not a pair making a token of the vocabulary")
    return merged, ids


def _pattern(pre: dict | None) -> str:
    """The split regex of a byte-level pre-tokenizer, or Unsupported."""
    if pre is None:
        raise Unsupported("no pre-tokenizer")
    if pre["type"] == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise Unsupported("ByteLevel with add_prefix_space or without its regex")
        return GPT2_PATTERN
    if pre["type"] == "Sequence" and len(pre["pretokenizers"]) == 2:
        split, level = pre["pretokenizers"]
        regex = split.get("pattern", {}).get("Regex")
        if (
            split["type"] == "Split"
            and regex
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and level["type"] == "ByteLevel"
            and not level.get("add_prefix_space")
            and not level.get("use_regex", True)
        ):
            return regex  # Llama 3 style: one Split, then a regex-less ByteLevel
    raise Unsupported(f"pre-tokenizer {pre['type']} is not a plain byte-level split")


@dataclass(frozen=True)
class TiktokenSpec:
    """Everything a worker needs to rebuild the Encoding (picklable, no file access)."""

    pattern: str
    ranks: dict[bytes, int]
    specials: dict[str, int]
    rank_to_id: np.ndarray | None  # None when tiktoken ranks already are the HF ids


def tiktoken_spec(tokenizer_json: str | Path) -> TiktokenSpec:
    """Translate a HF ``tokenizer.json`` into tiktoken terms, or raise Unsupported."""
    return spec_of(_tokenizer_data(Path(tokenizer_json)))


def _tokenizer_data(tokenizer_json: Path) -> dict:
    """The parsed file (3.5 MB for GPT-2, read before encoding can start). A file this parser
    refuses is Unsupported here: the sure path then loads it with Megatron's tokenizer and
    reports what that says."""
    try:
        return loads(tokenizer_json.read_bytes())
    except ValueError as exc:
        raise Unsupported(f"{tokenizer_json}: {exc}") from exc


def spec_and_facts(tokenizer_dir: Path) -> tuple[TiktokenSpec, int, int | None]:
    """(the tiktoken spec, vocabulary size with added tokens, id of ``eos_token``) from one
    read of ``tokenizer.json`` (and its config), without building a HF tokenizer: the
    tokenizer starts encoding this much sooner. Only a guess, like the encoder itself:
    Megatron's own vocabulary size and EOD confirm it (encoder_check.Guess) or tokenization
    is redone."""
    data = _tokenizer_data(tokenizer_dir / "tokenizer.json")
    spec = spec_of(data)
    vocab = data["model"]["vocab"]
    added = {a["content"]: a["id"] for a in data.get("added_tokens", [])}
    size = len(set(vocab.values()) | set(added.values()))
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # older configs store AddedToken dicts
        eos = eos.get("content")
    eod = added.get(eos, vocab.get(eos)) if isinstance(eos, str) else None
    return spec, size, eod


def spec_of(data: dict) -> TiktokenSpec:
    """:func:`tiktoken_spec` of a parsed ``tokenizer.json``."""
    model = data["model"]
    if model.get("type") != "BPE":
        raise Unsupported(f"model type {model.get('type')}")
    if model.get("dropout") or model.get("byte_fallback"):
        raise Unsupported("BPE dropout or byte fallback")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unsupported("subword prefix/suffix")
    if data.get("normalizer") is not None:
        raise Unsupported("a normalizer")
    pattern = _pattern(data.get("pre_tokenizer"))

    vocab: dict[str, int] = model["vocab"]
    ranks: dict[bytes, int] = {}
    ids: list[int] = []
    byte_chars = {b: c for c, b in byte_decoder().items()}
    for b in range(256):  # single bytes: never a merge result, so their rank is free
        char = byte_chars[b]
        if char not in vocab:
            raise Unsupported(f"byte {b} has no token")
        ranks[bytes([b])] = len(ids)
        ids.append(vocab[char])
    merged, merged_ids = _merge_results(model["merges"], vocab)
    keys = _tokens_bytes(merged)
    ranks.update(zip(keys, range(len(ids), len(ids) + len(keys)), strict=True))
    if len(ranks) != len(ids) + len(keys):  # two merges make one token: name it
        seen: set[bytes] = set()
        for key, token in zip(keys, merged, strict=True):
            if key in seen:
                raise Unsupported(f"two merges make {token!r}")
            seen.add(key)
    ids += merged_ids

    specials: dict[str, int] = {}
    for added in data.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            raise Unsupported(f"added token {added['content']!r} strips or needs word bounds")
        specials[added["content"]] = len(ids)
        ids.append(added["id"])

    lookup = np.asarray(ids, dtype=np.int64)
    if _ranks_are_ids(lookup, merges=slice(256, len(ranks))):
        # Merge order equals id order (GPT-2, HF-trained BPE): use the ids as ranks. Both
        # dicts hold their tokens in rank order, the order of ``ids``.
        ranks = dict(zip(ranks, ids[: len(ranks)], strict=True))
        specials = dict(zip(specials, ids[len(ranks) :], strict=True))
        return TiktokenSpec(pattern, ranks, specials, None)
    return TiktokenSpec(pattern, ranks, specials, lookup)


def _ranks_are_ids(ids: np.ndarray, merges: slice) -> bool:
    """True when using each token's HF id (``ids``, indexed by rank) as its rank keeps the
    merge priority order (the ids of the merges' results rise) and no two tokens share one."""
    merged = ids[merges]
    return bool(np.all(merged[1:] > merged[:-1])) and len(np.unique(ids)) == len(ids)


def build_encoding(spec: TiktokenSpec):
    import tiktoken

    return tiktoken.Encoding(
        "hf-bytelevel-bpe",
        pat_str=spec.pattern,
        mergeable_ranks=spec.ranks,
        special_tokens=spec.specials,
    )


class TiktokenEncoder:
    """HF ``encode(text, add_special_tokens=False)`` ids, computed by tiktoken.

    Each thread encodes with its own ``tiktoken.Encoding``, built on its first call. One
    Encoding shared by the encoding threads hands its regex scratch space out of a pool
    that only the thread that first used it reads without a lock (tiktoken 0.14, through
    fancy-regex and regex-automata): measured on the benchmark corpus (GPT-2, 2 threads,
    texts in memory), shared 5.5-6.1 M tokens/s in 7.2-7.8 CPU-s, one per thread 7.2-7.5 M
    in 5.8-5.9 CPU-s (profiled: ~11% of the shared run in the pool's get/put). A build is
    ~0.05 CPU-s and a few MB, once per thread.
    """

    def __init__(self, spec: TiktokenSpec):
        self.spec = spec
        self.allowed = frozenset(spec.specials)
        self.rank_to_id = spec.rank_to_id
        self._local = threading.local()

    @property
    def encoding(self):
        """This thread's Encoding."""
        encoding = getattr(self._local, "encoding", None)
        if encoding is None:
            encoding = self._local.encoding = build_encoding(self.spec)
        return encoding

    def encode(self, text: str) -> np.ndarray:
        # encode_to_numpy raises on lone surrogates instead of silently replacing them
        # (as encode() does); HF cannot encode them either, so both paths fail alike.
        ranks = self.encoding.encode_to_numpy(text, allowed_special=self.allowed)
        return ranks if self.rank_to_id is None else self.rank_to_id[ranks]


class HFEncoder:
    """HF ``tokenizers`` directly: the fallback when tiktoken cannot match."""

    def __init__(self, tokenizer_json: str | Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)
