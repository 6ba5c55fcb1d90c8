"""The reference trainer run in this process, the losses its log holds (for tests/trainer,
tests/pipeline and tests/export_eval), and the files a one-segment campaign of the synthetic
dataset needs on the cluster's shared filesystem (the stories under a real Airflow)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jobscripts import vocabulary
from jobscripts.job_files import REFERENCE_FAULTS
from operators.tracking import logparse


@dataclass
class Run:
    rc: int
    log: str
    segment: dict
    save: Path

    def records(self) -> list[vocabulary.Record]:
        return list(logparse.parse_lines(self.log.splitlines()))


def run_trainer(directory: Path, config: dict, *flags: str) -> Run:
    """One segment in this process (imports are paid once per session); stdout is the log."""
    from jobscripts.reference_trainer import main

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run.json").write_text(json.dumps(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--config", str(directory / "run.json"), *flags])
    segment = json.loads(Path(config["segment_result"]).read_text())
    return Run(rc, out.getvalue(), segment, Path(config["save"]))


def losses(log: str, allow_repeats: bool = False) -> dict[int, float]:
    """Per-iteration lm loss (a NaN iteration logs none); an iteration logged twice fails the
    test that asks."""
    found: dict[int, float] = {}
    for record in logparse.parse_lines(log.splitlines()):
        if record.kind == vocabulary.TRAIN and vocabulary.LM_LOSS in record.metrics:
            repeated = record.iteration in found and not allow_repeats
            assert not repeated, f"iteration {record.iteration} trained twice"
            found[record.iteration] = record.metrics[vocabulary.LM_LOSS]
    return found


SYNTHETIC_VOCAB = 256  # tests/trainer/synthetic_data.py's ids; EOD 0
CLUSTER_USER = "pretrain"  # who runs the jobs (docker/local_cluster.sh)


def write_word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the synthetic dataset's ids, EOD (EOS) 0: what the
    reference trainer reads its vocabulary size and EOD from (AutoTokenizer)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<eod>": 0, **{f"t{i}": i for i in range(1, SYNTHETIC_VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<eod>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eod>",
         "unk_token": "<eod>"}))


def lay_out_segment_campaigns(prefix: Path, faults: Iterable[tuple[object, dict]]) -> None:
    """The synthetic dataset at ``prefix`` with its tokenizer beside it, and for each
    (campaign, fault) pair (a ``Campaign`` whose data names them) a fresh campaign directory
    holding a copy of the tokenizer and the test-only fault file its trainer reads
    (jobscripts/trainer_faults.py), all owned by the cluster user."""
    from operators.campaign.render.layout import Layout
    from tests.trainer.synthetic_data import write_dataset

    data = prefix.parent
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    write_dataset(prefix)
    write_word_tokenizer(data / "tokenizer")
    owned = [data]
    for campaign, fault in faults:
        layout = Layout.for_campaign(campaign)
        shutil.rmtree(layout.campaign_dir, ignore_errors=True)
        shutil.copytree(data / "tokenizer", layout.tokenizer)
        Path(layout.checkpoints).mkdir(parents=True)
        Path(layout.checkpoints, REFERENCE_FAULTS).write_text(json.dumps(fault))
        owned.append(Path(layout.campaign_dir))
    for path in owned:
        subprocess.run(["chown", "-R", f"{CLUSTER_USER}:{CLUSTER_USER}", str(path)],
                       check=True)
