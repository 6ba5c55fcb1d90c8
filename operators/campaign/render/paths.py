"""The roots a training run needs on the cluster (the campaign and checkpoint directories, as
layout.py defines them) and its runtime inputs (data prefixes, tokenizer dir, code dir).

Each Slurm job also has its own run directory (``SlurmHook.run_dir(key)``, the job's
working directory) holding its script, rendered config and ``segment.json``: those are
named relative to it, so nothing here depends on the job key.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING

from operators.campaign.render import layout
from operators.campaign.schema.fields import checked_path

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign


@dataclass(frozen=True)
class RunPaths:
    campaign_dir: str
    checkpoint_dir: str
    # Known only once the data stage has run (from its manifest): the Megatron prefixes and
    # the trained tokenizer's directory. None where the campaign names them itself.
    data_prefixes: tuple[str, ...] | None = None
    tokenizer_dir: str | None = None
    code_dir: str | None = None  # a checkout holding jobscripts/, put on PYTHONPATH

    def __post_init__(self) -> None:
        # These reach YAML and shell lines; the schema's rules apply to them too.
        checked_path("run_paths.campaign_dir", self.campaign_dir)
        checked_path("run_paths.checkpoint_dir", self.checkpoint_dir)
        for i, prefix in enumerate(self.data_prefixes or ()):
            checked_path(f"run_paths.data_prefixes[{i}]", prefix)
        for name in ("tokenizer_dir", "code_dir"):
            if getattr(self, name) is not None:
                checked_path(f"run_paths.{name}", getattr(self, name))

    @classmethod
    def for_campaign(cls, campaign: Campaign, *, data_prefixes=None,
                     tokenizer_dir: str | None = None, code_dir: str | None = None) -> RunPaths:
        return cls(
            campaign_dir=layout.campaign_dir(campaign),
            checkpoint_dir=layout.checkpoint_dir(campaign),
            data_prefixes=tuple(data_prefixes) if data_prefixes is not None else None,
            tokenizer_dir=tokenizer_dir, code_dir=code_dir)

    @property
    def data_dir(self) -> str:
        return posixpath.join(self.campaign_dir, layout.DATA)

    @property
    def manifest(self) -> str:
        return layout.manifest_path(self.data_dir)

    @property
    def tensorboard_dir(self) -> str:
        return posixpath.join(self.campaign_dir, layout.TENSORBOARD)

    @property
    def data_cache_dir(self) -> str:
        return posixpath.join(self.campaign_dir, layout.DATA_CACHE)
