"""Export or evaluate several checkpoints of a campaign, one after the other, in one job.

    python -m jobscripts.checkpoint_eval --step export|evaluate --iterations 4 8
        --checkpoint-root ROOT --output-root DIR [--result PATH] -- STEP FLAGS...

The per-checkpoint evaluation DAG (operators/campaign/dag/eval_dag.py) runs this twice per
DAG run: ``export`` in the export stage's image (``jobscripts.export_hf --iteration N``),
then ``evaluate`` in the evaluation image (``jobscripts.evaluate``, the campaign's backend);
the two can be different containers on the Bridge path, so they are two jobs. Each
checkpoint is its own process (vLLM keeps one engine per process) and its own folder:

    DIR/iter_0000004/hf/             the export
    DIR/iter_0000004/export.json     export_hf's result
    DIR/iter_0000004/eval.json       evaluate's result

A checkpoint that retention removed before its export is skipped and said so (``skipped``),
never an error; any other failure of one checkpoint fails the job after the others ran.

Result JSON: ok, error, step, checkpoints {iteration: the step's result JSON, trimmed to
its figures}, skipped [iteration], seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from jobscripts import checkpoints
from jobscripts.common import StepError, log, run_step

RESULT_NAME = "checkpoint_eval.json"
EXPORT_RESULT = "export.json"
EVAL_RESULT = "eval.json"
HF_DIR = "hf"
# What of each step's result goes into this job's result (an XCom: keep it small).
KEPT = ("ok", "error", "iteration", "perplexity", "bits_per_byte", "nll_per_token",
        "bits_per_token", "tokens_evaluated", "bytes_evaluated", "documents_evaluated",
        "samples", "backend")


def checkpoint_folder(output_root: str | Path, iteration: int) -> Path:
    """Where one checkpoint's export and evaluation go (named like its checkpoint)."""
    return Path(output_root) / checkpoints.checkpoint_dir("", iteration).name


def _command(args: argparse.Namespace, iteration: int, folder: Path) -> list[str]:
    if args.step == "export":
        return [sys.executable, "-m", "jobscripts.export_hf", "--checkpoint-root",
                args.checkpoint_root, "--iteration", str(iteration), "--output",
                str(folder / HF_DIR), "--result", str(folder / EXPORT_RESULT), *args.rest]
    return [sys.executable, "-m", "jobscripts.evaluate", "--model", str(folder / HF_DIR),
            "--output-dir", str(folder), "--result", str(folder / EVAL_RESULT), *args.rest]


def _body(args: argparse.Namespace) -> dict:
    done: dict[str, dict] = {}
    skipped: list[int] = []
    for iteration in args.iterations:
        folder = checkpoint_folder(args.output_root, iteration)
        source = (checkpoints.checkpoint_dir(args.checkpoint_root, iteration)
                  if args.step == "export" else folder / HF_DIR)
        if not source.is_dir():
            log(f"checkpoint {iteration}: {source} is gone (retention removed it): skipped")
            skipped.append(iteration)
            continue
        folder.mkdir(parents=True, exist_ok=True)
        log(f"checkpoint {iteration}: {args.step}")
        subprocess.run(_command(args, iteration, folder), check=False)
        result_file = folder / (EXPORT_RESULT if args.step == "export" else EVAL_RESULT)
        try:
            result = json.loads(result_file.read_text())
        except (OSError, ValueError) as exc:
            result = {"ok": False, "error": f"no result from {args.step}: {exc}"}
        done[str(iteration)] = {k: result[k] for k in KEPT if k in result}
    failed = {i: r.get("error") for i, r in done.items() if not r.get("ok")}
    payload = {"checkpoints": done, "skipped": skipped}
    if failed:
        raise StepError(f"{args.step} failed for checkpoint(s) " + "; ".join(
            f"{i}: {e}" for i, e in failed.items()), payload)
    return payload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.checkpoint_eval")
    p.add_argument("--step", choices=("export", "evaluate"), required=True)
    p.add_argument("--iterations", type=int, nargs="+", required=True)
    p.add_argument("--checkpoint-root", required=True)
    p.add_argument("--output-root", required=True)
    p.add_argument("--result", help=f"default: <output root>/{RESULT_NAME}")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="after --: the step's own flags")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    return run_step(f"checkpoint_{args.step}", args, Path(args.output_root) / RESULT_NAME,
                    _body)


if __name__ == "__main__":
    sys.exit(main())
