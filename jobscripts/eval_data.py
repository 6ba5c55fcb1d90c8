"""Held-out documents of a Megatron dataset: the ones training never saw.

Megatron splits each ``*_text_document`` prefix into train / valid / test by contiguous
ranges of its sequence index (one sequence per document: tokenization never splits
sentences), from the ``split`` weights ("95,5,0"). Training draws only from the train range
and validation never takes a gradient step, so the test range is held out when the test
weight is non-zero, and the valid range otherwise.

``split_ranges`` computes the ranges exactly as megatron-core 0.16 does (its
``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix`` and the rounding in
``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``): the same float arithmetic,
so no boundary document can land on the other side. tests/export_eval/test_eval_data.py
checks it against megatron-core's own builder.

The documents are read with megatron-core's ``IndexedDataset``: token ids exactly as trained
(the evaluation never re-tokenizes them), the trailing EOD dropped (evaluation puts an EOD
before each document instead, as packing does; see jobscripts/eval_metrics.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

SPLITS = ("train", "valid", "test")
HELDOUT_CHOICES = ("auto", "test", "valid")


def split_weights(split: str) -> list[float]:
    """Megatron's reading of a split string: up to three numbers, missing ones 0, normalised."""
    import numpy as np

    numbers = [float(n) for n in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(numbers) <= len(SPLITS):
        raise ValueError(f"split {split!r}: expected 1 to 3 weights (train,valid,test)")
    numbers += [0.0] * (len(SPLITS) - len(numbers))
    weights = np.array(numbers, dtype=np.float64)
    if weights.sum() <= 0:
        raise ValueError(f"split {split!r}: the weights sum to zero")
    # numpy's float64 division, then Python float sums below: the same roundings as Megatron.
    return (weights / weights.sum()).tolist()


def split_ranges(split: str, documents: int) -> list[tuple[int, int] | None]:
    """Per split (train, valid, test): the document range ``[begin, end)``, or None for a
    split of weight zero (Megatron builds no dataset for it). A range may be empty when the
    weight is too small for the document count."""
    if documents < 0:
        raise ValueError(f"documents must be >= 0 (got {documents})")
    bounds = [0.0]
    for weight in split_weights(split):
        bounds.append(bounds[-1] + weight)
    ranges: list[tuple[int, int] | None] = []
    for low, high in zip(bounds, bounds[1:], strict=False):
        if high <= low:
            ranges.append(None)
        else:  # Python's round(): halves to even, as Megatron's int(round(...))
            ranges.append((int(round(low * float(documents))), int(round(high * float(documents)))))
    return ranges


def heldout_range(split: str, documents: int, which: str = "auto") -> tuple[str, int, int]:
    """(split name, begin, end) of the documents to evaluate on.

    ``auto``: the test range when it has documents, else the valid range. A test range that
    rounds to nothing still leaves the valid documents, which training never saw either.
    """
    if which not in HELDOUT_CHOICES:
        raise ValueError(f"held-out split must be one of {HELDOUT_CHOICES} (got {which!r})")
    ranges = dict(zip(SPLITS, split_ranges(split, documents), strict=True))
    for name in (("test", "valid") if which == "auto" else (which,)):
        found = ranges[name]
        if found is not None and found[1] > found[0]:
            return name, found[0], found[1]
    wanted = "test or valid" if which == "auto" else which
    raise ValueError(f"split {split!r} leaves no {wanted} documents among {documents}: every "
                     f"document is trained on, so nothing is held out")


@dataclass(frozen=True)
class HeldoutDataset:
    prefix: str
    split: str  # "test" or "valid"
    documents: int  # in the whole prefix
    begin: int
    end: int

    def record(self, evaluated: Sequence[int]) -> dict:
        """What the result JSON says about this prefix; ``evaluated``: the indices scored."""
        return {"prefix": self.prefix, "split": self.split, "documents": self.documents,
                "split_range": [self.begin, self.end], "split_documents": self.end - self.begin,
                "evaluated_documents": len(evaluated),
                "evaluated_range": [min(evaluated), max(evaluated) + 1] if evaluated else None}


def open_heldout(prefixes: Sequence[str], split: str, which: str = "auto"):
    """(HeldoutDataset, IndexedDataset) per prefix; errors name the prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    opened = []
    for prefix in prefixes:
        dataset = IndexedDataset(prefix, multimodal=False, mmap=True)
        try:
            name, begin, end = heldout_range(split, len(dataset), which)
        except ValueError as exc:
            raise ValueError(f"{prefix}: {exc}") from exc
        opened.append((HeldoutDataset(prefix, name, len(dataset), begin, end), dataset))
    return opened


def heldout_documents(opened, eod: int) -> Iterator[tuple[int, int, list[int]]]:
    """(prefix number, document index, token ids without the trailing EOD), lazily.

    Several prefixes are interleaved document by document, so a document cap samples each
    of them rather than only the first.
    """
    cursors = [heldout.begin for heldout, _ in opened]
    while True:
        progressed = False
        for number, (heldout, dataset) in enumerate(opened):
            index = cursors[number]
            if index >= heldout.end:
                continue
            cursors[number] += 1
            progressed = True
            ids = [int(t) for t in dataset[index]]
            if ids and ids[-1] == eod:
                ids.pop()
            yield number, index, ids
        if not progressed:
            return
