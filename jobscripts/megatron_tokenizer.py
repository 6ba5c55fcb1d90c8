"""Megatron's own tokenizer, built the way ``tools/preprocess_data.py`` builds it.

Megatron-LM core_v0.16.1 ``preprocess_data.py --tokenizer-type HuggingFaceTokenizer``
builds ``MegatronTokenizer.from_pretrained(path, metadata_path={"library":
"huggingface"}, ...)`` unless ``--legacy-tokenizer`` is given. Its ``tokenize(text)``
is ``convert_tokens_to_ids(AutoTokenizer.tokenize(text))``: no BOS, no special
tokens added, but special tokens written in the text are recognised. The legacy
tokenizer (megatron.training, not shipped in the megatron-core wheel) returns
``AutoTokenizer(text).input_ids`` instead: with the post-processor's BOS, e.g.
Llama 3's ``<|begin_of_text|>``. With ``--append-eod`` the tool appends ``eod``
(the id of ``eos_token``) to every document that has at least one token; an empty
document stays empty. The output dtype is uint16 when ``vocab_size`` (``len`` of
the HF tokenizer, added tokens included) is under 65,500, else int32.

Importing megatron.core takes ~18 s here (it pulls in torch and most of the
library), so callers do it once, in one process.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


def load(path: str | Path, legacy: bool = False):
    """A tokenizer with ``tokenize(text) -> list[int]``, ``eod`` and ``vocab_size``."""
    if legacy:
        return LegacyHFTokenizer(str(path))
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(path),
        metadata_path={"library": "huggingface"},
        vocab_file=None,
        merges_file=None,
        additional_special_tokens=[],
        use_fast=False,
        trust_remote_code=False,
        include_special_tokens=False,
    )


class LegacyHFTokenizer:
    """megatron.training.tokenizer's _HuggingFaceTokenizer, as far as tokenization goes."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def output_dtype(vocab_size: int) -> type[np.number]:
    """DType.optimal_dtype, without importing megatron for one comparison."""
    return np.uint16 if vocab_size < 65500 else np.int32


def reference_document(tokenizer, text, append_eod: bool = True) -> tuple[list[int], list[int]]:
    """(ids, sentence lengths) for one document, exactly as ``Encoder.encode`` makes them."""
    sentences = text if isinstance(text, list) else [text]
    ids: list[int] = []
    lengths: list[int] = []
    for sentence in sentences:
        sentence_ids = tokenizer.tokenize(sentence)
        if len(sentence_ids) > 0:
            ids.extend(sentence_ids)
            lengths.append(len(sentence_ids))
    if len(ids) > 0 and append_eod:
        ids.append(tokenizer.eod)
        lengths[-1] += 1
    return ids, lengths


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()
