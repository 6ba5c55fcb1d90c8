"""The per-checkpoint evaluation's two jobs (export, then evaluate) as ``JobRequest``s. Pure.

Both run ``jobscripts.checkpoint_eval`` over the checkpoints the evaluation DAG's run has to
score, with the same flags as the campaign's final export and evaluate stages
(operators/campaign/render/stages.py), placed as those stages are (placement.py):

    <campaign>/checkpoint_evals/iter_XXXXXXX/{hf/,export.json,eval.json}
    <campaign>/checkpoint_evals/ledger.jsonl     one line per checkpoint announced, evaluated
                                                 or skipped (operators/campaign/dag/eval_dag.py)
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from jobscripts.checkpoint_eval import EVAL_RESULT, checkpoint_folder
from operators.campaign.render import stages
from operators.campaign.render.layout import RESULT_FILE, Layout
from operators.campaign.render.paths import loaded_tokenizer
from operators.campaign.render.placement import stage_command, stage_launch
from operators.slurm.messages import JobRequest

if TYPE_CHECKING:
    from collections.abc import Sequence

    from operators.campaign.schema.config import Campaign

EVALS_DIR = "checkpoint_evals"
LEDGER = "ledger.jsonl"
MODULE = "jobscripts.checkpoint_eval"
BACKENDS = ("vllm", "transformers")


def evals_dir(layout: Layout) -> str:
    return posixpath.join(layout.campaign_dir, EVALS_DIR)


def ledger_path(layout: Layout) -> str:
    return posixpath.join(evals_dir(layout), LEDGER)


def eval_result_path(layout: Layout, iteration: int) -> str:
    """The evaluation of checkpoint ``iteration`` (eval.json), once it ran."""
    return posixpath.join(str(checkpoint_folder(evals_dir(layout), iteration)), EVAL_RESULT)


def _request(campaign: Campaign, layout: Layout, stage: str, step: str,
             iterations: Sequence[int], rest: list[object]) -> JobRequest:
    launch = stage_launch(campaign, stage)
    command = stage_command(campaign, launch, MODULE, "--result", RESULT_FILE, "--step", step,
                            "--iterations", *iterations, "--checkpoint-root",
                            layout.checkpoints, "--output-root", evals_dir(layout), "--",
                            *rest)
    return JobRequest(command, launch.job, environment=dict(campaign.cluster.environment),
                      result_file=RESULT_FILE)


def export_request(campaign: Campaign, layout: Layout, iterations: Sequence[int]) -> JobRequest:
    """Hugging Face exports of ``iterations`` (the final export's flags: tokenizer, Bridge)."""
    rest: list[object] = ["--tokenizer", loaded_tokenizer(campaign, layout)]
    if campaign.model.recipe is not None:
        from operators.campaign.schema.rules import recipe_hf_model

        rest += ["--bridge", "--hf-model", recipe_hf_model(campaign)]
    return _request(campaign, layout, "export", "export", iterations, rest)


def evaluate_request(campaign: Campaign, layout: Layout, iterations: Sequence[int],
                     backend: str = "vllm") -> JobRequest:
    """Held-out perplexity, bits per byte and samples of each export, as the final evaluate
    stage scores (``backend`` vllm: its CPU build locally, the GPU image in production)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (got {backend!r})")
    rest: list[object] = [*stages.heldout_data_args(campaign, layout),
                          "--split", campaign.data.split,
                          "--max-model-len", campaign.training.seq_length,
                          "--backend", backend, "--max-documents", stages.EVAL_DOCUMENTS,
                          "--max-new-tokens", 32, "--prompt", "The"]
    return _request(campaign, layout, "evaluate", "evaluate", iterations, rest)
