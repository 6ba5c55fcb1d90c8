"""Where a campaign's files live on the cluster: one directory per campaign.

    <remote_root>/<name>/checkpoints/   iter_XXXXXXX/ + latest_checkpointed_iteration.txt
    <remote_root>/<name>/data/          the data stage's .bin/.idx, manifest.json, tokenizer/
    <remote_root>/<name>/tensorboard/   one event stream for all segments
    <remote_root>/<name>/data_cache/    Megatron's dataset index cache

Each Slurm job also has its own run directory (``SlurmHook.run_dir(key)``, the job's
working directory) holding its script, rendered config and ``segment.json``: those are
named relative to it, so nothing here depends on the job key.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from operators.campaign.fields import checked_path


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
    def for_campaign(cls, campaign, *, data_prefixes=None, tokenizer_dir: str | None = None,
                     code_dir: str | None = None) -> RunPaths:
        root = campaign.cluster.remote_root
        # Without remote_root (the schema then requires checkpoint.dir) the campaign dir is
        # the checkpoint dir's parent.
        campaign_dir = posixpath.join(root, campaign.name) if root else posixpath.dirname(
            campaign.checkpoint.dir.rstrip("/"))
        return cls(
            campaign_dir=campaign_dir,
            checkpoint_dir=campaign.checkpoint.dir or posixpath.join(campaign_dir, "checkpoints"),
            data_prefixes=tuple(data_prefixes) if data_prefixes is not None else None,
            tokenizer_dir=tokenizer_dir, code_dir=code_dir)

    @property
    def data_dir(self) -> str:
        return posixpath.join(self.campaign_dir, "data")

    @property
    def manifest(self) -> str:
        return posixpath.join(self.data_dir, "manifest.json")

    @property
    def tensorboard_dir(self) -> str:
        return posixpath.join(self.campaign_dir, "tensorboard")

    @property
    def data_cache_dir(self) -> str:
        return posixpath.join(self.campaign_dir, "data_cache")
