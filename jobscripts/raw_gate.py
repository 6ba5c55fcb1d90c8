"""Raw-data gate: a great-expectations suite over a sample of the JSONL shards.

    python -m jobscripts.raw_gate --input OUT/jsonl --output-dir GATE
        [--sample-size 10000 | --full] [--seed 0] [--min-chars 1] [--max-chars 0]
        [--max-duplicate-rate 0.01] [--max-replacement-share 0.001]
        [--max-nonprintable-share 0.001] [--max-line-errors 0] [--result PATH]

Every line is scanned for faults GX cannot see (not UTF-8, not JSON, not an
object); a deterministic sample of the good lines is reduced to per-document
features and validated by GX (ephemeral context, pandas datasource). The result
JSON lists each expectation with its observed value and threshold; the Data Docs
HTML goes to GATE/data_docs. A failing gate exits 1 and its error lists every
failed expectation with its observed value and example lines.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from jobscripts.common import StepError, entry_point, log
from jobscripts.jsonl_scan import scan

EXAMPLES = 5  # failing lines quoted per expectation in the error message


def expectation_specs(args: argparse.Namespace) -> list[tuple[str, str, str, dict, str]]:
    """(name, GX class, column, kwargs, threshold in words) for each check."""
    lengths = {"min_value": max(1, args.min_chars)}
    if args.max_chars:
        lengths["max_value"] = args.max_chars
    bound = f">= {lengths['min_value']}" + (f" and <= {args.max_chars}" if args.max_chars else "")
    return [
        ("text_present", "ExpectColumnValuesToNotBeNull", "text_chars", {}, "no null/missing text"),
        ("text_length", "ExpectColumnValuesToBeBetween", "text_chars", lengths, f"chars {bound}"),
        ("id_present", "ExpectColumnValuesToNotBeNull", "id", {}, "no null/missing id"),
        ("id_unique", "ExpectColumnValuesToBeUnique", "id", {}, "ids unique"),
        (
            "duplicate_rate",
            "ExpectColumnProportionOfUniqueValuesToBeBetween",
            "text_sha1",
            {"min_value": 1.0 - args.max_duplicate_rate},
            f"duplicate rate <= {args.max_duplicate_rate}",
        ),
        (
            "replacement_share",
            "ExpectColumnMeanToBeBetween",
            "replacement_share",
            {"max_value": args.max_replacement_share},
            f"mean U+FFFD share <= {args.max_replacement_share}",
        ),
        (
            "nonprintable_share",
            "ExpectColumnMeanToBeBetween",
            "nonprintable_share",
            {"max_value": args.max_nonprintable_share},
            f"mean non-printable share <= {args.max_nonprintable_share}",
        ),
    ]


def run_gx(rows: list[dict], specs, docs_dir: Path) -> tuple[list[dict], dict]:
    """Validate the feature rows with GX and build Data Docs; return per-expectation results."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # no phoning home from compute nodes
    timings = {}
    started = time.monotonic()
    import great_expectations as gx
    import pandas as pd
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    timings["import"] = time.monotonic() - started
    started = time.monotonic()
    site = {
        "class_name": "SiteBuilder",
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        "store_backend": {
            "class_name": "TupleFilesystemStoreBackend",
            "base_directory": str(docs_dir),
        },
    }
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        data_docs_sites={"gate": site},
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
    )
    context = gx.get_context(project_config=config, mode="ephemeral")
    batch = context.data_sources.add_pandas("jsonl").add_dataframe_asset("sample")
    batch = batch.add_batch_definition_whole_dataframe("rows")
    suite = gx.ExpectationSuite(name="raw_gate")
    for _name, cls, column, kwargs, _words in specs:
        suite.add_expectation(getattr(gx.expectations, cls)(column=column, **kwargs))
    suite = context.suites.add(suite)
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="raw_gate", data=batch, suite=suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="raw_gate",
            validation_definitions=[definition],
            actions=[gx.checkpoint.UpdateDataDocsAction(name="docs", site_names=["gate"])],
            result_format={
                "result_format": "SUMMARY",
                "unexpected_index_column_names": ["file", "line"],
                "partial_unexpected_count": EXAMPLES,
            },
        )
    )
    frame = pd.DataFrame(
        rows,
        columns=[
            "file",
            "line",
            "id",
            "text_chars",
            "text_sha1",
            "replacement_share",
            "nonprintable_share",
        ],
    )
    outcome = checkpoint.run(batch_parameters={"dataframe": frame})
    timings["validate_and_docs"] = time.monotonic() - started
    results = next(iter(outcome.run_results.values())).results
    by_type_column = {
        (r.expectation_config.type, r.expectation_config.kwargs["column"]): r for r in results
    }
    out = []
    for name, cls, column, kwargs, words in specs:
        snake = "expect_" + _snake(cls.removeprefix("Expect"))
        res = by_type_column[(snake, column)]
        out.append(summarize(name, column, words, kwargs, res.success, res.result))
    return out, {k: round(v, 3) for k, v in timings.items()}


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def summarize(name, column, words, kwargs, success, result) -> dict:
    """A plain-JSON view of one GX result: observed value, threshold, example lines."""
    if "observed_value" in result:
        observed = result["observed_value"]  # None when the column holds no value at all
        observed = None if observed is None else float(observed)
        if name == "duplicate_rate" and observed is not None:
            observed = 1.0 - observed  # GX observes the unique share; report the duplicate rate
    else:
        observed = {
            "unexpected_count": int(result.get("unexpected_count", 0)),
            "element_count": int(result.get("element_count", 0)),
        }
    examples = [
        f"{row['file']}:{int(row['line'])}"
        for row in result.get("partial_unexpected_index_list") or []
    ]
    return {
        "name": name,
        "column": column,
        "success": bool(success),
        "observed_value": observed,
        "threshold": words,
        "kwargs": kwargs,
        "examples": examples[:EXAMPLES],
    }


def describe(check: dict) -> str:
    observed = check["observed_value"]
    if isinstance(observed, dict):
        observed = f"{observed['unexpected_count']} of {observed['element_count']} rows fail"
    examples = check["examples"]
    more = f" and {len(examples) - EXAMPLES} more" if len(examples) > EXAMPLES else ""
    where = f" (e.g. {', '.join(examples[:EXAMPLES])}{more})" if examples else ""
    return f"{check['name']}: observed {observed}, expected {check['threshold']}{where}"


def gate(args: argparse.Namespace) -> dict:
    source = Path(args.input)
    paths = sorted(source.glob("*.jsonl")) if source.is_dir() else [source]
    if not paths:
        raise StepError(f"no *.jsonl file in {source}")
    out = Path(args.output_dir)
    started = time.monotonic()
    scanned = scan(paths, args.sample_size, args.seed, args.full, args.text_key, args.id_key)
    scan_seconds = round(time.monotonic() - started, 3)
    log(
        f"scanned {scanned.lines} lines in {len(paths)} files in {scan_seconds} s: "
        f"{scanned.issue_count} bad lines, {len(scanned.rows)} documents sampled"
    )
    if not scanned.rows:
        issues = [str(i) for i in [*scanned.file_issues, *scanned.issues][:EXAMPLES]]
        raise StepError(f"no valid document in {source}: {'; '.join(issues)}")
    checks, gx_seconds = run_gx(scanned.rows, expectation_specs(args), out / "data_docs")
    log(f"GX: {gx_seconds}")
    line_check = {
        "name": "lines_valid",
        "column": None,
        "success": scanned.issue_count <= args.max_line_errors,
        "observed_value": {"unexpected_count": scanned.issue_count, "element_count": scanned.lines},
        "threshold": f"at most {args.max_line_errors} bad lines",
        "kwargs": {},
        "examples": [str(issue) for issue in [*scanned.file_issues, *scanned.issues]],
    }
    checks.insert(0, line_check)
    payload = {
        "input_files": [str(p) for p in paths],
        "lines": scanned.lines,
        "sampled": len(scanned.rows),
        "full_scan": args.full,
        "line_errors": [str(issue) for issue in [*scanned.file_issues, *scanned.issues]],
        "expectations": checks,
        "data_docs": str(out / "data_docs" / "index.html"),
        "timings": {"scan": scan_seconds, **gx_seconds},
    }
    failed = [c for c in checks if not c["success"]]
    for check in checks:
        log(("PASS " if check["success"] else "FAIL ") + describe(check))
    if failed:
        raise StepError(
            f"raw gate failed {len(failed)} of {len(checks)} checks: "
            + "; ".join(describe(c) for c in failed),
            payload,
        )
    return payload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.raw_gate", description=__doc__)
    p.add_argument("--input", required=True, help="a directory of *.jsonl shards, or one file")
    p.add_argument("--output-dir", required=True, help="result JSON and data_docs/ go here")
    p.add_argument("--sample-size", type=int, default=10_000, help="documents given to GX")
    p.add_argument("--full", action="store_true", help="give GX every document, not a sample")
    p.add_argument("--seed", type=int, default=0, help="sample seed")
    p.add_argument("--text-key", default="text")
    p.add_argument("--id-key", default="id")
    p.add_argument("--min-chars", type=int, default=1, help="shortest allowed text (>= 1)")
    p.add_argument("--max-chars", type=int, default=0, help="longest allowed text (0: no limit)")
    p.add_argument("--max-duplicate-rate", type=float, default=0.01)
    p.add_argument("--max-replacement-share", type=float, default=0.001, help="U+FFFD")
    p.add_argument("--max-nonprintable-share", type=float, default=0.001)
    p.add_argument("--max-line-errors", type=int, default=0, help="bad JSONL lines tolerated")
    return p


main = entry_point("raw_gate", parser, gate, "raw_gate.json")


if __name__ == "__main__":
    raise SystemExit(main())
