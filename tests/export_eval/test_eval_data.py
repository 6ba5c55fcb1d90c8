"""Held-out split boundaries against megatron-core's own builder, and the documents read."""

from __future__ import annotations

import numpy as np
import pytest

from jobscripts.eval_data import (
    heldout_documents,
    heldout_range,
    open_heldout,
    split_ranges,
    split_weights,
)

EOD = 0
DOCUMENT_COUNTS = (1, 2, 3, 5, 6, 7, 10, 14, 33, 100, 299, 1000, 4097)
# "3,0,1", "1,1" and "1,1,2" put boundaries on exact halves (0.75 x 6 = 4.5): Megatron rounds
# those to even, which rounding half up would get wrong.
SPLITS = ("95,5,0", "969,30,1", "90,10,0", "80,10,10", "1,1,1", "100,0,0", "98,2", "3,0,1",
          "1,1", "1,1,2", "99.5,0.4,0.1", "949,50,1", "33,33,34", "1")


def write_prefix(prefix, documents: int):
    """``documents`` documents of 1-3 tokens + EOD; document i's first token is i % 60000 + 1."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(documents):
        ids = [i % 60000 + 1] * (1 + i % 3) + [EOD]
        builder.add_document(np.array(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> dict[int, str]:
    base = tmp_path_factory.mktemp("eval_data")
    return {n: write_prefix(base / f"docs{n}_text_document", n) for n in DOCUMENT_COUNTS}


def megatron_split_indices(prefix: str, split: str, cache) -> list[tuple[int, int] | None]:
    """Each split's document indices as megatron-core's BlendedMegatronDatasetBuilder derives
    them for GPTDataset. The dataset class only records the indices it is handed: building
    real GPT samples adds nothing to the split and cannot take an empty range."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from jobscripts.trainer_data import DatasetTokenizer

    class Recorded(GPTDataset):
        def __init__(self, low_level, path, indexed_indices, num_samples, index_split, config):
            self.indices = indexed_indices

        def __len__(self) -> int:
            return 0

    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([prefix], None),
                              split=split, path_to_cache=str(cache),
                              tokenizer=DatasetTokenizer(vocab_size=60001, eod=EOD),
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    built = BlendedMegatronDatasetBuilder(Recorded, [1, 1, 1], lambda: True, config).build()
    ranges = []
    for dataset in built:
        if dataset is None:
            ranges.append(None)
            continue
        indices = dataset.indices.tolist()
        assert indices == list(range(indices[0], indices[-1] + 1)) if indices else True
        ranges.append((indices[0], indices[-1] + 1) if indices else "empty")
    return ranges


@pytest.mark.parametrize("split", SPLITS)
def test_split_ranges_equal_megatron_cores(split, prefixes, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    assert split_weights(split) == parse_and_normalize_split(split)
    for documents, prefix in prefixes.items():
        ours = split_ranges(split, documents)
        expected = megatron_split_indices(prefix, split, tmp_path)
        # An empty range is a dataset without indices there: compare where it would start.
        assert [("empty" if r is not None and r[0] == r[1] else r) for r in ours] == expected, (
            split, documents)
        present = [r for r in ours if r is not None]
        assert present[0][0] == 0 and present[-1][1] == documents  # every document, once
        assert all(a[1] == b[0] for a, b in zip(present, present[1:], strict=False))


@pytest.mark.parametrize("split, documents, which, expected", [
    ("95,5,0", 300, "auto", ("valid", 285, 300)),  # no test share: validation is held out
    ("90,5,5", 300, "auto", ("test", 285, 300)),
    ("90,5,5", 300, "valid", ("valid", 270, 285)),
    ("969,30,1", 40, "auto", ("valid", 39, 40)),  # the test share rounds to no document
    ("969,30,1", 1000, "auto", ("test", 999, 1000)),
])
def test_heldout_range_prefers_a_nonempty_test_split(split, documents, which, expected):
    assert heldout_range(split, documents, which) == expected


@pytest.mark.parametrize("split, documents, which, message", [
    ("100,0,0", 50, "auto", "no test or valid documents among 50"),
    ("969,30,1", 10, "auto", "no test or valid documents among 10"),  # both round to nothing
    ("95,5,0", 50, "test", "no test documents"),
    ("1,2,3,4", 50, "auto", "expected 1 to 3 weights"),
    ("0,0,0", 50, "auto", "sum to zero"),
])
def test_nothing_held_out_is_refused(split, documents, which, message):
    with pytest.raises(ValueError, match=message):
        heldout_range(split, documents, which)


def test_documents_are_the_splits_without_their_eod(prefixes):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    opened = open_heldout([prefixes[33], prefixes[10]], "80,10,10")
    assert [(h.split, h.begin, h.end, h.documents) for h, _ in opened] == [
        ("test", 30, 33, 33), ("test", 9, 10, 10)]
    read = list(heldout_documents(opened, EOD))
    # Interleaved across prefixes, then the longer one goes on alone.
    assert [(number, index) for number, index, _ in read] == [(0, 30), (1, 9), (0, 31), (0, 32)]
    raw = IndexedDataset(prefixes[33])
    for number, index, ids in read:
        source = raw if number == 0 else IndexedDataset(prefixes[10])
        assert ids + [EOD] == source[index].tolist()
    assert opened[0][0].record([30, 32]) == {
        "prefix": prefixes[33], "split": "test", "documents": 33, "split_range": [30, 33],
        "split_documents": 3, "evaluated_documents": 2, "evaluated_range": [30, 33]}
