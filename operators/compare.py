"""Compare an experiment's campaigns: loss against tokens consumed, plus a table of final metrics.

    pretrain-pipeline compare EXPERIMENT [--tracking-uri URI] [--output compare.png]
        [--reference CSV [--reference-label TEXT]] [--logx] [--dpi 100]

Reads every campaign (parent run) of the MLflow experiment and the segment runs under it,
joins their metric histories into one curve per campaign (a step logged by a later segment,
e.g. a retry that redid iterations, replaces the earlier value), puts loss on tokens consumed
(``tokens_consumed`` logged with step = iteration), and writes:
- ``compare.png``: training loss (left), validation loss (middle) and held-out bits per byte
  of every evaluated checkpoint (right: ``eval_bits_per_byte`` at step = iteration, on
  ``eval_tokens_consumed``; docs/health.md), one line per campaign in the same colour; the
  reference curve (CSV with a ``tokens`` column and ``val_loss`` and/or ``bits_per_byte``,
  e.g. llm.c's GPT-2 124M on FineWeb, ~3.28 after 10B tokens) dashed on the validation panel
  and the bits-per-byte panel;
- ``compare.csv`` and ``compare.md`` beside it, and the table on stdout: final tokens, losses,
  and the evaluation's perplexity and bits per byte. Losses in nats per token depend on the
  tokenizer; bits per byte does not, so it is the column to compare across tokenizers.
A campaign without ``tokens_consumed`` cannot be placed on the x axis: it is left off the plot
and says so in the table.

Campaigns whose run carries the goodput figures (logged when the campaign is registered:
operators/tracking/goodput.py, operators/campaign/adapters/goodput_log.py) also get:
- dotted marks on the loss plot where each segment resumed from a checkpoint;
- ``compare_goodput.csv`` / ``.md`` (and on stdout): goodput = training-step time / allocated
  time, and each component (start-up, saves, loads, queue wait, gaps, work redone, hangs);
- ``compare_timeline.png``: each segment's queue wait, start-up, training, final save and
  failed or requeued runs on the wall clock, one panel per campaign.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jobscripts.vocabulary import EVAL_METRICS, LM_LOSS, TOKENS_CONSUMED, VAL_LM_LOSS
from operators.campaign.adapters.checkpoint_eval_log import EVAL_TOKENS_CONSUMED
from operators.tracking import goodput, names
from operators.tracking.runs import PARENT_TAG

HELP = "plot loss vs tokens for an experiment's campaigns and tabulate final metrics"
CURVES = (LM_LOSS, VAL_LM_LOSS)
# Held-out bits per byte of every evaluated checkpoint (the evaluation DAG's, step =
# iteration, and the final evaluate's): comparable across tokenizers, unlike the losses.
BPB_CURVE = EVAL_METRICS["bits_per_byte"]
EVAL_COLUMNS = (EVAL_METRICS["perplexity"], EVAL_METRICS["bits_per_byte"])
COLUMNS = ("run", "run_id", "status", "tokens", LM_LOSS, VAL_LM_LOSS, *EVAL_COLUMNS, "note")
GOODPUT_FIELDS = tuple(goodput.Goodput.__dataclass_fields__)
GOODPUT_COLUMNS = ("run", *GOODPUT_FIELDS)
TIMELINE_METRICS = (names.TIMELINE_SEGMENT, names.TIMELINE_KIND, names.TIMELINE_START,
                    names.TIMELINE_END)
SPAN_COLORS = {goodput.QUEUE: "#bbbbbb", goodput.STARTUP: "#f0a030",
               goodput.TRAINING: "#2ca02c", goodput.SAVE: "#1f77b4", goodput.FAILED: "#d62728"}


@dataclass
class Campaign:
    name: str
    run_id: str
    status: str
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # (tokens, v)
    final: dict[str, float] = field(default_factory=dict)
    note: str = ""
    goodput: dict[str, float] = field(default_factory=dict)  # Goodput field -> value
    # (segment, kind, start, end in Unix seconds): the bars of the timeline
    timeline: list[tuple[int, str, float, float]] = field(default_factory=list)
    resumed_tokens: list[float] = field(default_factory=list)  # where segments resumed

    def row(self) -> dict[str, object]:
        tokens = max((x for key in CURVES for x, _ in self.curves.get(key) or ()), default=None)
        values = {k: self.final.get(k) for k in (LM_LOSS, VAL_LM_LOSS, *EVAL_COLUMNS)}
        return {"run": self.name, "run_id": self.run_id, "status": self.status,
                "tokens": tokens, **values, "note": self.note}


def merge_histories(histories: Iterable[Sequence[tuple[int, float]]]) -> list[tuple[int, float]]:
    """(step, value) histories of consecutive runs -> one; later runs win on a shared step."""
    merged: dict[int, float] = {}
    for history in histories:
        merged.update(dict(history))
    return sorted(merged.items())


def on_tokens(points: Sequence[tuple[int, float]], tokens: Sequence[tuple[int, float]]):
    """Place (step, value) on the token axis; steps between token records are interpolated."""
    import numpy as np

    if not tokens:
        return []
    steps, counts = zip(*tokens, strict=True)
    return [(float(np.interp(step, steps, counts)), value) for step, value in points
            if math.isfinite(value)]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    # One value per step: the last logged (a re-logged step keeps its newest value).
    ordered = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return list({m.step: m.value for m in ordered}.items())


def read_timeline(histories: dict[str, list[tuple[int, float]]]
                  ) -> list[tuple[int, str, float, float]]:
    """The timeline metrics (step = span number) -> (segment, kind, start, end) spans."""
    columns = [dict(histories.get(key) or ()) for key in TIMELINE_METRICS]
    spans = []
    for step in sorted(set.intersection(*(set(c) for c in columns))):
        segment, kind, start, end = (c[step] for c in columns)
        if 0 <= int(kind) < len(goodput.SPAN_KINDS):
            spans.append((int(segment), goodput.SPAN_KINDS[int(kind)], start, end))
    return spans


def _search_all(client, experiment_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token,
                                  order_by=["attributes.start_time ASC"])
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def load_campaigns(client, experiment: str) -> list[Campaign]:
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise SystemExit(f"compare: no MLflow experiment named {experiment!r}")
    runs = _search_all(client, found.experiment_id)
    children: dict[str, list] = {}
    for run in runs:
        parent = run.data.tags.get(PARENT_TAG)
        if parent:
            children.setdefault(parent, []).append(run)
    campaigns = []
    for run in runs:
        if run.data.tags.get(PARENT_TAG):
            continue
        family = [run, *children.get(run.info.run_id, [])]  # start-time order from the search
        merged = {key: merge_histories(_history(client, r.info.run_id, key) for r in family)
                  for key in (*CURVES, TOKENS_CONSUMED)}
        campaign = Campaign(run.info.run_name or run.info.run_id, run.info.run_id,
                            run.info.status)
        for key in CURVES:
            campaign.curves[key] = on_tokens(merged[key], merged[TOKENS_CONSUMED])
            if merged[key]:
                campaign.final[key] = merged[key][-1][1]
        for key in EVAL_COLUMNS:
            if key in run.data.metrics:
                campaign.final[key] = run.data.metrics[key]
        evaluated = _history(client, run.info.run_id, BPB_CURVE)
        tokens_at = _history(client, run.info.run_id, EVAL_TOKENS_CONSUMED) \
            or merged[TOKENS_CONSUMED]
        campaign.curves[BPB_CURVE] = on_tokens(evaluated, tokens_at)
        if not merged[TOKENS_CONSUMED]:
            campaign.note = f"no {TOKENS_CONSUMED} metric: not plotted"
        campaign.goodput = {f: run.data.metrics[names.goodput_metric(f)] for f in GOODPUT_FIELDS
                            if names.goodput_metric(f) in run.data.metrics}
        if campaign.goodput:
            campaign.timeline = read_timeline(
                {key: _history(client, run.info.run_id, key) for key in TIMELINE_METRICS})
            resumed = _history(client, run.info.run_id, names.RESUMED_FROM)
            campaign.resumed_tokens = [x for x, _ in on_tokens(
                [(int(iteration), 0.0) for _, iteration in resumed], merged[TOKENS_CONSUMED])]
        campaigns.append(campaign)
    return campaigns


REFERENCE_LOSS, REFERENCE_BPB = "val_loss", "bits_per_byte"  # the reference CSV's columns


def read_reference_curves(path: Path) -> dict[str, list[tuple[float, float]]]:
    """The reference CSV's curves: ``tokens`` and one or both of ``val_loss`` (nats per
    token, the validation panel) and ``bits_per_byte`` (the held-out panel); a row may leave
    one of them empty. A bad value names its line."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        columns = set(reader.fieldnames or ())
        wanted = [c for c in (REFERENCE_LOSS, REFERENCE_BPB) if c in columns]
        if "tokens" not in columns or not wanted:
            raise SystemExit(f"compare: {path} needs columns tokens and val_loss and/or "
                             f"bits_per_byte (has {reader.fieldnames})")
        curves: dict[str, list[tuple[float, float]]] = {c: [] for c in wanted}
        for row in reader:
            for column in wanted:
                if (row.get(column) or "").strip():
                    try:
                        curves[column].append((float(row["tokens"]), float(row[column])))
                    except ValueError as exc:
                        raise SystemExit(f"compare: {path}:{reader.line_num}: {column}: "
                                         f"{exc}") from None
        return {c: sorted(points) for c, points in curves.items()}


def read_reference(path: Path) -> list[tuple[float, float]]:
    """The reference's validation-loss curve (empty when it gives bits per byte only)."""
    return read_reference_curves(path).get(REFERENCE_LOSS, [])


def plot(campaigns: Sequence[Campaign], reference: Sequence[tuple[float, float]] = (),
         reference_label: str = "reference", logx: bool = False, title: str = "",
         reference_bpb: Sequence[tuple[float, float]] = ()):
    """The figure (Agg, no display needed): left training loss, middle validation loss,
    right held-out bits per byte (when there is a curve of it, or a reference one)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    # The bits-per-byte panel once some campaign has a curve of it (two evaluated checkpoints
    # or more): a lone final evaluation is in the table.
    bpb = any(len(c.curves.get(BPB_CURVE) or ()) > 1 for c in campaigns) or bool(reference_bpb)
    figure = Figure(figsize=(18 if bpb else 12, 4.5), layout="constrained")
    axes = figure.subplots(1, 3 if bpb else 2, sharex=True)
    for index, campaign in enumerate(campaigns):
        color = f"C{index % 10}"
        points = campaign.curves.get(BPB_CURVE) or []
        if bpb and points:  # every evaluated checkpoint: a marker each
            xs, ys = zip(*points, strict=True)
            axes[2].plot(xs, ys, color=color, marker="o", label=campaign.name, linewidth=1.5)
        for axis, key in zip(axes, CURVES, strict=False):
            points = campaign.curves.get(key) or []
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, color=color, label=campaign.name, linewidth=1.5)
            if campaign.resumed_tokens:  # where a segment resumed from a checkpoint
                axis.vlines(campaign.resumed_tokens, 0, 1, transform=axis.get_xaxis_transform(),
                            colors=color, linestyles=":", linewidth=1, alpha=0.7)
    if reference:
        xs, ys = zip(*reference, strict=True)
        axes[1].plot(xs, ys, color="black", linestyle="--", label=reference_label)
    if reference_bpb:
        xs, ys = zip(*reference_bpb, strict=True)
        axes[2].plot(xs, ys, color="black", linestyle="--", label=reference_label)
    for axis, name, unit in zip(axes, ("training loss", "validation loss",
                                        "held-out bits per byte (each checkpoint)"),
                                ("loss (nats/token)", "loss (nats/token)", "bits per byte"),
                                strict=False):
        axis.set_title(name)
        axis.set_xlabel("tokens consumed")
        axis.set_ylabel(unit)
        axis.grid(True, alpha=0.3)
        if logx:
            axis.set_xscale("log")
        if axis.lines:
            axis.legend(fontsize="small")
    if title:
        figure.suptitle(title)
    return figure


def plot_timeline(campaigns: Sequence[Campaign]):
    """One panel per campaign with a timeline: a row per segment, seconds since its first
    submission on x, a bar per span coloured by what the time went to."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    drawn = [c for c in campaigns if c.timeline]
    rows = max((max(s for s, *_ in c.timeline) for c in drawn), default=1)
    figure = Figure(figsize=(12, 1.5 + 0.45 * rows * max(1, len(drawn))), layout="constrained")
    axes = figure.subplots(max(1, len(drawn)), 1, squeeze=False)[:, 0]
    for axis, campaign in zip(axes, drawn, strict=False):
        origin = min(start for _, _, start, _ in campaign.timeline)
        for segment, kind, start, end in campaign.timeline:
            axis.broken_barh([(start - origin, max(end - start, 0.0))], (segment - 0.4, 0.8),
                             facecolors=SPAN_COLORS[kind])
        share = campaign.goodput.get(names.GOODPUT)
        axis.set_title(campaign.name + (f": goodput {share:.1%}" if share is not None else ""))
        axis.set_yticks(range(1, rows + 1), [f"segment {i}" for i in range(1, rows + 1)])
        axis.invert_yaxis()
        axis.set_xlabel("seconds since the first segment's submission")
        axis.grid(True, axis="x", alpha=0.3)
    figure.legend(handles=[Patch(color=SPAN_COLORS[k], label=k) for k in goodput.SPAN_KINDS],
                  fontsize="small", ncols=len(goodput.SPAN_KINDS), loc="outside lower center")
    return figure


def write_goodput(campaigns: Sequence[Campaign], png: Path) -> str:
    """``<png>_goodput.csv`` / ``.md`` beside the PNG, one row per campaign with goodput
    figures; returns the markdown ("" when no campaign has any)."""
    rows = [{"run": c.name, **c.goodput} for c in campaigns if c.goodput]
    if not rows:
        return ""
    stem = png.with_name(png.stem + "_goodput")
    with open(stem.with_suffix(".csv"), "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=GOODPUT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(GOODPUT_COLUMNS) + " |", "|" + "---|" * len(GOODPUT_COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in GOODPUT_COLUMNS) + " |" for r in rows]
    markdown = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(markdown, encoding="utf-8")
    return markdown


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
    return "" if value is None else str(value)


def write_tables(campaigns: Sequence[Campaign], png: Path) -> str:
    """CSV (full precision) and markdown beside the PNG; returns the markdown."""
    rows = [c.row() for c in campaigns]
    with open(png.with_suffix(".csv"), "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    markdown = "\n".join(lines) + "\n"
    png.with_suffix(".md").write_text(markdown, encoding="utf-8")
    return markdown


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="MLflow experiment name")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="MLflow server (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--output", default="compare.png", help="PNG path; tables go beside it")
    parser.add_argument("--reference", help="CSV with tokens and val_loss and/or "
                                            "bits_per_byte columns to overlay")
    parser.add_argument("--reference-label", default="reference")
    parser.add_argument("--logx", action="store_true", help="log-scale token axis")
    parser.add_argument("--dpi", type=int, default=100)


def run(args: argparse.Namespace) -> int:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=args.tracking_uri)
    campaigns = load_campaigns(client, args.experiment)
    if not campaigns:
        raise SystemExit(f"compare: experiment {args.experiment!r} has no campaign runs")
    reference = read_reference_curves(Path(args.reference)) if args.reference else {}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure = plot(campaigns, reference.get(REFERENCE_LOSS, []), args.reference_label,
                  args.logx, args.experiment, reference_bpb=reference.get(REFERENCE_BPB, []))
    figure.savefig(output, dpi=args.dpi)
    print(write_tables(campaigns, output), end="", flush=True)
    print(f"wrote {output}, {output.with_suffix('.csv')}, {output.with_suffix('.md')}",
          flush=True)
    breakdown = write_goodput(campaigns, output)
    if breakdown:
        timeline = output.with_name(output.stem + "_timeline.png")
        plot_timeline(campaigns).savefig(timeline, dpi=args.dpi)
        print(breakdown, end="", flush=True)
        print(f"wrote {timeline}, {output.with_name(output.stem + '_goodput.csv')}, "
              f"{output.with_name(output.stem + '_goodput.md')}", flush=True)
    return 0
