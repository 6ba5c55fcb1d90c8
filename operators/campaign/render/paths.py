"""A training run's runtime inputs: what is known only once the task runs (the data stage's
prefixes, the trained tokenizer's directory, the shipped code), beside the campaign's
directories (layout.py's ``Layout``).

Each Slurm job also has its own run directory (``SlurmHook.run_dir(key)``, the job's
working directory) holding its script, rendered config and ``segment.json``: those are
named relative to it, so nothing here depends on the job key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from operators.campaign.schema.fields import checked_path

if TYPE_CHECKING:
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.config import Campaign

# Where the data stage will put the dataset, for rendering a job before it ran (DAG parse,
# `pretrain-pipeline check`): no job option depends on it.
STAND_IN_PREFIX = "/dataset-known-when-run_text_document"


@dataclass(frozen=True)
class RunInputs:
    # From the data stage's manifest: the Megatron prefixes; None where the campaign names
    # its data itself (data.prefixes or data.blend: the renderers read those).
    data_prefixes: tuple[str, ...] | None = None
    tokenizer_dir: str | None = None  # the trained tokenizer; None: data.tokenizer.path
    code_dir: str | None = None  # a directory holding jobscripts/, put on PYTHONPATH

    def __post_init__(self) -> None:
        # These reach YAML and shell lines; the schema's rules apply to them too. (The field
        # names are "run_paths.": what campaign authors' tooling has matched on.)
        for i, prefix in enumerate(self.data_prefixes or ()):
            checked_path(f"run_paths.data_prefixes[{i}]", prefix)
        for name in ("tokenizer_dir", "code_dir"):
            if getattr(self, name) is not None:
                checked_path(f"run_paths.{name}", getattr(self, name))

    @classmethod
    def of(cls, data_prefixes: Iterable[str] | None = None, tokenizer_dir: str | None = None,
           code_dir: str | None = None) -> RunInputs:
        return cls(tuple(data_prefixes) if data_prefixes is not None else None,
                   tokenizer_dir, code_dir)

    @classmethod
    def stand_in(cls, campaign: Campaign, layout: Layout) -> RunInputs:
        """The inputs a job is rendered with before its run: the tokenizer where the data
        stage saves it, :data:`STAND_IN_PREFIX` where the manifest will name the data."""
        data = campaign.data
        own = data.prefixes or data.blend is not None
        return cls(None if own else (STAND_IN_PREFIX,), layout.tokenizer)


def data_path(campaign: Campaign, inputs: RunInputs) -> list[str]:
    """What the run trains on: the data stage's prefixes, else the campaign's own prefixes,
    else its blend as weight, prefix, weight, prefix, ... (the reference trainer's data path;
    the data check before a segment reads it too)."""
    data = campaign.data
    if inputs.data_prefixes is not None:
        return list(inputs.data_prefixes)
    if data.prefixes:
        return list(data.prefixes)
    return [x for item in data.blend or () for x in (str(item.weight), item.prefix)]


def loaded_tokenizer(campaign: Campaign, layout: Layout) -> str:
    """The tokenizer the segments loaded, which an export ships beside the weights:
    ``data.tokenizer.path`` when the campaign names one, else the data stage's (the layout's
    ``data/tokenizer``, which a campaign with its own prefixes and tokenizer never fills)."""
    return tokenizer_dir(campaign, RunInputs.of(), default=layout.tokenizer)


def tokenizer_dir(campaign: Campaign, inputs: RunInputs, default: str | None = None) -> str:
    """The tokenizer directory a run loads (both trainers): ``data.tokenizer.path`` when the
    campaign names one (a campaign with its own prefixes runs no data stage that would copy
    it into the campaign's directory), else the data stage's trained tokenizer
    (``inputs.tokenizer_dir``, else ``default``)."""
    if campaign.data.tokenizer.path is not None:
        return campaign.data.tokenizer.path
    if inputs.tokenizer_dir is None and default is None:
        raise ValueError("data.tokenizer.train: pass RunInputs(tokenizer_dir=...), where the "
                         "data stage saved the trained tokenizer")
    return inputs.tokenizer_dir or default
