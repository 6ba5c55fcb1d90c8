"""``pretrain-pipeline compare`` against a real MLflow server: curves, table and the PNG itself."""

from __future__ import annotations

import csv
import time

import numpy as np
import pytest

from operators import cli, compare

EXPERIMENT = "compare-test"
COLORS = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E), "C2": (0x2C, 0xA0, 0x2C)}


def log_segment(client, experiment_id, parent_id, steps, tokens_per_step, offset, tokens=True):
    from mlflow.entities import Metric

    run = client.create_run(experiment_id, tags={"mlflow.parentRunId": parent_id})
    now = int(time.time() * 1000)
    metrics = [Metric("lm_loss", 5.0 / (1 + 0.1 * s) + offset, now, s) for s in steps]
    metrics += [Metric("val_lm_loss", 5.2 / (1 + 0.1 * s) + offset, now, s)
                for s in steps if s % 5 == 0]
    if tokens:
        metrics += [Metric("tokens_consumed", s * tokens_per_step, now, s) for s in steps]
    client.log_batch(run.info.run_id, metrics=metrics)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def experiment(mlflow_uri):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment_id = client.create_experiment(EXPERIMENT)
    parents = {}
    for name, tokens_per_step, offset in (("llama-bpe", 1000, 0.0), ("llama-big-vocab", 1500, 0.3)):
        parent = client.create_run(experiment_id, run_name=name).info.run_id
        log_segment(client, experiment_id, parent, range(1, 11), tokens_per_step, offset)
        # The second segment is a retry that redid iterations 9 and 10: its values win.
        log_segment(client, experiment_id, parent, range(9, 21), tokens_per_step, offset - 0.01)
        parents[name] = parent
    client.log_metric(parents["llama-bpe"], "eval_bits_per_byte", 1.05, step=20)
    client.log_metric(parents["llama-bpe"], "eval_perplexity", 20.5, step=20)
    untracked = client.create_run(experiment_id, run_name="no-tokens").info.run_id
    log_segment(client, experiment_id, untracked, range(1, 5), 0, 0.0, tokens=False)
    return client, parents


@pytest.fixture(scope="module")
def campaigns(experiment) -> list:
    return compare.load_campaigns(experiment[0], EXPERIMENT)


def test_curves_join_segments_on_the_token_axis(campaigns):
    campaigns = {c.name: c for c in campaigns}
    assert set(campaigns) == {"llama-bpe", "llama-big-vocab", "no-tokens"}
    bpe = campaigns["llama-bpe"]
    train = dict(bpe.curves["lm_loss"])
    assert sorted(train) == [s * 1000.0 for s in range(1, 21)]
    assert train[9000.0] == pytest.approx(5.0 / 1.9 - 0.01)  # the retry's value
    assert [x for x, _ in bpe.curves["val_lm_loss"]] == [5000.0, 10000.0, 15000.0, 20000.0]
    assert bpe.final["lm_loss"] == pytest.approx(5.0 / 3.0 - 0.01)
    assert bpe.final["eval_bits_per_byte"] == pytest.approx(1.05)
    assert max(x for x, _ in campaigns["llama-big-vocab"].curves["lm_loss"]) == 30000.0
    assert campaigns["no-tokens"].curves["lm_loss"] == []
    assert "not plotted" in campaigns["no-tokens"].note


def test_merge_histories_later_runs_win():
    assert compare.merge_histories([[(1, 5.0), (2, 4.0)], [(2, 3.9), (3, 3.5)]]) == [
        (1, 5.0), (2, 3.9), (3, 3.5)]


def test_on_tokens_interpolates_between_token_records():
    assert compare.on_tokens([(1, 2.0), (3, 1.0), (4, float("nan"))],
                             [(1, 100.0), (5, 500.0)]) == [(100.0, 2.0), (300.0, 1.0)]


def test_compare_cli_writes_png_with_one_line_per_run_and_tables(experiment, campaigns, tmp_path,
                                                                 capsys):
    from PIL import Image

    client, parents = experiment
    reference = tmp_path / "llmc_gpt2_124m.csv"
    reference.write_text("tokens,val_loss\n0,11.0\n10000,4.0\n30000,3.28\n")

    # The figure as drawn: one line per plotted run on each panel, plus the reference.
    figure = compare.plot(campaigns, compare.read_reference(reference))
    train_axis, val_axis = figure.axes
    assert [line.get_label() for line in train_axis.lines] == ["llama-bpe", "llama-big-vocab"]
    assert [line.get_label() for line in val_axis.lines] == [
        "llama-bpe", "llama-big-vocab", "reference"]
    assert len({line.get_color() for line in val_axis.lines}) == 3

    png = tmp_path / "out" / "compare.png"
    rc = cli.main(["compare", EXPERIMENT, "--tracking-uri", client.tracking_uri,
                   "--output", str(png), "--reference", str(reference), "--dpi", "80"])
    assert rc == 0
    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert image.shape == (360, 960, 3)  # figsize (12, 4.5) at 80 dpi

    def pixels(rgb) -> int:
        return int((np.abs(image - np.array(rgb)).sum(axis=-1) < 30).sum())

    # Both runs' colours are drawn; no third run colour (no-tokens is not plotted).
    assert pixels(COLORS["C0"]) > 200 and pixels(COLORS["C1"]) > 200
    assert pixels(COLORS["C2"]) == 0
    # The right half (validation panel) holds the dashed black reference.
    assert (np.abs(image[:, 480:]).sum(axis=-1) < 40).sum() > 100

    rows = list(csv.DictReader(png.with_suffix(".csv").read_text().splitlines()))
    assert [r["run"] for r in rows] == ["llama-bpe", "llama-big-vocab", "no-tokens"]
    assert float(rows[0]["eval_bits_per_byte"]) == pytest.approx(1.05)
    assert rows[0]["run_id"] == parents["llama-bpe"] and float(rows[0]["tokens"]) == 20000.0
    markdown = png.with_suffix(".md").read_text()
    assert markdown.splitlines()[0].startswith("| run | run_id |")
    out = capsys.readouterr().out
    assert "llama-big-vocab" in out and "eval_bits_per_byte" in out


def test_cli_lists_compare_and_rejects_unknown_experiment(mlflow_uri, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "compare" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no MLflow experiment named 'nope'"):
        cli.main(["compare", "nope", "--tracking-uri", mlflow_uri])
