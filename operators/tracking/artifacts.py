"""Which files go to a run's artifact store, where, and the one kind that never does.

Uploaded: rendered configs and job scripts, job logs, GX reports (HTML), the dataset manifest,
evaluation results, plots. Never uploaded: checkpoints (~100 GB for 8B at every save, which is
what Bridge's own MLflow logger does; docs/tracking.md): their URI is recorded as a tag instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobscripts.job_files import ITER_DIR_RE, TRACKER_FILENAME

# Artifact paths by kind: one tree per run, the same in every run, so runs compare.
CONFIGS = "configs"  # rendered run config (YAML), campaign YAML
JOBSCRIPTS = "jobscripts"  # rendered sbatch scripts
LOGS = "logs"  # Slurm job logs
REPORTS = "reports"  # Great Expectations HTML
DATA = "data"  # manifest.json
EVAL = "eval"  # evaluation results
PLOTS = "plots"

CHECKPOINT_URI = "checkpoint_uri"  # tag: where the latest checkpoint of this run is
CHECKPOINT_ITERATION = "checkpoint_iteration"
# tag: why a resume did not load the checkpoint the tracker named (corrupt, missing)
CHECKPOINT_FALLBACK = "checkpoint_fallback"


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is in a Megatron checkpoint tree (an ``iter_XXXXXXX`` directory, or one
    holding the tracker file) or, for a directory, holds one anywhere below it."""
    path = Path(path).absolute()
    for part in (path, *path.parents):
        if ITER_DIR_RE.match(part.name) or (part / TRACKER_FILENAME).is_file():
            return True
    return path.is_dir() and any(ITER_DIR_RE.match(p.name) or p.name == TRACKER_FILENAME
                                 for p in path.rglob("*"))


def upload(client, run_id: str, local_path: str | os.PathLike,
           artifact_path: str | None = None) -> None:
    """A file, or a directory's files, to the run's artifact store under ``artifact_path``."""
    local_path = Path(local_path)
    if is_checkpoint(local_path):
        raise ValueError(f"{local_path} is (in) a checkpoint: record its URI with "
                         "checkpoint_tags(), never upload it")
    if local_path.is_dir():
        client.log_artifacts(run_id, str(local_path), artifact_path)
    elif local_path.is_file():
        client.log_artifact(run_id, str(local_path), artifact_path)
    else:
        raise FileNotFoundError(local_path)


def checkpoint_tags(uri: str, iteration: int | None = None) -> dict[str, str]:
    """Tags that say where a checkpoint is (a tag, not a param: it moves on every segment)."""
    tags = {CHECKPOINT_URI: uri}
    if iteration is not None:
        tags[CHECKPOINT_ITERATION] = str(iteration)
    return tags
