"""Held-out language-model metrics from per-token log-probabilities: the one metric code path.

Every backend (transformers on CPU, vLLM offline, a ``vllm serve`` endpoint) is fed the same
token windows built here and hands back one log-probability per scored token; the sums and
the final figures are computed here and nowhere else, so the backends can only differ in the
numbers the model produces, never in how they are counted.

Definitions (natural logs throughout):
  nll_per_token  = -sum(logprob) / tokens              (nats)
  perplexity     = exp(nll_per_token)
  bits_per_byte  = -sum(logprob) / ln 2 / UTF-8 bytes of the evaluated text
Bits per byte does not depend on the tokenizer, so runs with different vocabularies compare.

Documents are scored as training saw them: each is preceded by the EOD token (in packed
training data a document follows the previous one's EOD), and every token of the text is
scored given what precedes it in its window. No token outside the text is scored, so the
byte count and the scored tokens cover exactly the same text.

Documents arrive as text (a JSONL held-out file, tokenized here) or as token ids read from the
tokenized dataset's held-out split (jobscripts/eval_data.py); both pass through
``take_documents`` and the same windows, so either way a backend sees only token ids.

No torch or vLLM here: pure functions, tested alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Document:
    token_ids: list[int]  # the text's tokens, without the leading EOD
    n_bytes: int  # UTF-8 bytes of the text these tokens cover
    truncated: bool = False  # cut by the token budget
    source: object = None  # where it came from (the caller's label), for the result JSON


def take_documents(
    items: Iterable[tuple[Sequence[int], int | None, object]],
    decode: Callable[[list[int]], str],
    max_documents: int | None = None,
    max_tokens: int | None = None,
) -> list[Document]:
    """Documents from ``(token ids, UTF-8 bytes or None, source)`` items, up to
    ``max_documents``, stopping at ``max_tokens`` scored tokens.

    The bytes are those of the text the ids came from; None (ids read from a tokenized
    dataset, no text at hand) counts the bytes of the decoded ids. The document that
    crosses the token budget is cut and counts the bytes of its decoded kept tokens, so bits
    per byte always divides by the text actually scored. Documents without tokens are
    skipped: there is nothing to score.
    """
    documents: list[Document] = []
    budget = max_tokens if max_tokens is not None else math.inf
    remaining = iter(items)
    # Caps are checked before the next item is pulled: nothing past them is read or encoded.
    while (max_documents is None or len(documents) < max_documents) and budget > 0:
        item = next(remaining, None)
        if item is None:
            break
        ids, n_bytes, source = item
        ids = list(ids)
        if not ids:
            continue
        if len(ids) > budget:
            ids = ids[: int(budget)]
            documents.append(Document(ids, len(decode(ids).encode("utf-8")), True, source))
        else:
            if n_bytes is None:
                n_bytes = len(decode(ids).encode("utf-8"))
            documents.append(Document(ids, n_bytes, False, source))
        budget -= len(ids)
    return documents


def prepare_documents(
    texts: Iterable[str],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    max_documents: int | None = None,
    max_tokens: int | None = None,
) -> list[Document]:
    """Tokenize up to ``max_documents`` texts (see ``take_documents``); empty texts are
    skipped. Texts are encoded lazily: the caps stop reading early."""
    items = ((encode(text), len(text.encode("utf-8")), None) for text in texts)
    return take_documents(items, decode, max_documents, max_tokens)


def windows(token_ids: Sequence[int], context_id: int, window_len: int) -> list[list[int]]:
    """Cut ``[context_id] + token_ids`` into windows of at most ``window_len`` tokens.

    Consecutive windows overlap by one token, so each window's first token is context only
    and every other token is scored exactly once, given up to ``window_len - 1`` predecessors.
    ``window_len`` is ``max_model_len - 1``: vLLM needs room to generate one token after a
    prompt (prompt + max_tokens <= max_model_len), and both backends use the same windows.
    """
    if window_len < 2:
        raise ValueError(f"window_len must be at least 2 (got {window_len})")
    full = [context_id, *token_ids]
    step = window_len - 1
    return [full[start:start + window_len] for start in range(0, len(full) - 1, step)]


@dataclass
class Totals:
    """Running sums over documents; ``summary`` turns them into the reported metrics."""

    nll_nats: float = 0.0
    tokens: int = 0
    bytes: int = 0
    documents: int = 0
    truncated: int = 0
    per_document_nll: list[float] = field(default_factory=list)

    def add_document(self, document: Document, window_logprobs: Sequence[Sequence[float]]):
        scored = [lp for window in window_logprobs for lp in window]
        if len(scored) != len(document.token_ids):
            # A backend that dropped or added a position would silently skew every figure.
            raise ValueError(f"expected {len(document.token_ids)} token log-probabilities for "
                             f"a document, the backend returned {len(scored)}")
        nll = -math.fsum(scored)
        self.nll_nats += nll
        self.tokens += len(scored)
        self.bytes += document.n_bytes
        self.documents += 1
        self.truncated += int(document.truncated)
        self.per_document_nll.append(nll)

    def summary(self) -> dict[str, float | int | None]:
        if not self.tokens:
            raise ValueError("no token was evaluated (empty or missing held-out texts?)")
        nll_per_token = self.nll_nats / self.tokens
        return {
            "nll_per_token": nll_per_token,
            "perplexity": math.exp(nll_per_token) if nll_per_token < 700 else math.inf,
            "bits_per_token": nll_per_token / LN2,
            "bits_per_byte": self.nll_nats / LN2 / self.bytes if self.bytes else None,
            "tokens_evaluated": self.tokens,
            "bytes_evaluated": self.bytes,
            "documents_evaluated": self.documents,
            "documents_truncated": self.truncated,
        }


def score(documents: Sequence[Document], context_id: int, window_len: int,
          logprobs_of: Callable[[list[list[int]]], list[list[float]]]) -> Totals:
    """Feed every document's windows to ``logprobs_of`` (one backend call) and sum.

    ``logprobs_of`` takes windows and returns, per window, the log-probabilities of its
    tokens after the first (``len(window) - 1`` values).
    """
    per_doc = [windows(d.token_ids, context_id, window_len) for d in documents]
    flat = [w for doc_windows in per_doc for w in doc_windows]
    results = logprobs_of(flat)
    if len(results) != len(flat):
        raise ValueError(f"backend returned {len(results)} results for {len(flat)} windows")
    totals, cursor = Totals(), 0
    for document, doc_windows in zip(documents, per_doc, strict=True):
        totals.add_document(document, results[cursor:cursor + len(doc_windows)])
        cursor += len(doc_windows)
    return totals


# --- backend outputs -> per-token log-probabilities (duck-typed, no vLLM import) -----------
def from_prompt_logprobs(prompt_logprobs: Sequence[Mapping[int, object] | None],
                         prompt_token_ids: Sequence[int]) -> list[float]:
    """vLLM's ``RequestOutput.prompt_logprobs``: one ``{token_id: Logprob}`` per prompt
    position (``None``, or an empty mapping with FlatLogprobs, at position 0). With
    ``prompt_logprobs=1`` each mapping holds the top-1 token and the actual prompt token."""
    if len(prompt_logprobs) != len(prompt_token_ids):
        raise ValueError(f"prompt_logprobs has {len(prompt_logprobs)} positions for "
                         f"{len(prompt_token_ids)} prompt tokens")
    values = []
    for position in range(1, len(prompt_token_ids)):
        entry = prompt_logprobs[position]
        token = prompt_token_ids[position]
        if not entry or token not in entry:
            raise ValueError(f"no log-probability for prompt token {token} at position "
                             f"{position} (was prompt_logprobs set?)")
        values.append(float(entry[token].logprob))
    return values


def from_openai_echo(choice: Mapping, n_prompt_tokens: int) -> list[float]:
    """An OpenAI ``/v1/completions`` choice with ``echo=True, logprobs=1, max_tokens=0``:
    ``logprobs.token_logprobs`` has one value per prompt token, ``None`` for the first."""
    token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if token_logprobs is None or len(token_logprobs) < n_prompt_tokens:
        raise ValueError(f"expected {n_prompt_tokens} echoed token logprobs, got "
                         f"{None if token_logprobs is None else len(token_logprobs)}")
    values = token_logprobs[1:n_prompt_tokens]
    if any(v is None for v in values):
        raise ValueError("an echoed prompt token after the first has no logprob")
    return [float(v) for v in values]
