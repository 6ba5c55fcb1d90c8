"""Benchmark: MLflow logging throughput for a 100,000-iteration training log (issue 6 §7).

    python -m tests.bench.bench_mlflow      (from the repository root; not collected by pytest)

Prints one JSON line:
``{"bench": "mlflow_logging", "records": N, "seconds": X, "naive_seconds": X}``.

The log is 100,000 Megatron iteration lines in the reference workflow's format (logging every
iteration), parsed by logparse; ``records`` counts the metric values they yield (each line's
fields and ``tokens_consumed``: 10 per iteration). ``seconds``: those values through the
tracker's batched path (points, 1,000-value ``log_batch`` ops) to a real ``mlflow server``
(SQLite, ``--workers 1``) on this machine. ``naive_seconds``: one ``log_metric`` call per value,
timed on a 500-value sample and scaled to ``records``. Parsing time goes to stderr, not into
either figure. Servers boot while the log is parsed (outside the timings) and stop at the end.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tests.support.mlflow_server import tracking_servers
from tests.tracking.logs import SEQ_LENGTH, iteration_line

ITERATIONS = 100_000
NAIVE_SAMPLE = 500
BUCKET = "bench"


def main(iterations: int = ITERATIONS) -> int:
    from operators.tracking import logparse

    with (tempfile.TemporaryDirectory(prefix="bench-mlflow-") as tmp,
          tracking_servers(Path(tmp), BUCKET, wait=False) as (_, server)):
        started = time.perf_counter()  # parse while mlflow boots
        records = list(logparse.parse_lines(
            iteration_line(i, iterations) for i in range(1, iterations + 1)))
        parse_s = time.perf_counter() - started

        from operators.tracking import metrics
        from operators.tracking.client import make_client
        from operators.tracking.settings import tracking_settings
        from operators.tracking.tracker import Tracker

        server.wait_ready()
        client = make_client(tracking_settings(server.connection()))
        spool = Path(tmp) / "spool"
        tracker = Tracker(client, spool)
        parent = tracker.campaign_run("bench", "bench-batched", None)  # DB set up: untimed

        started = time.perf_counter()
        values = tracker.log_metrics(parent, records, seq_length=SEQ_LENGTH,
                                     timestamp_ms=1_700_000_000_000)
        seconds = time.perf_counter() - started
        if (spool / "ops.jsonl").exists() or (spool / "rejected.jsonl").exists():
            raise RuntimeError(f"values were spooled or refused: see {spool}")

        naive_run = tracker.campaign_run("bench", "bench-naive", None)
        sample = metrics.points(records[:NAIVE_SAMPLE], SEQ_LENGTH)[:NAIVE_SAMPLE]
        started = time.perf_counter()
        for name, value, step in sample:
            client.log_metric(naive_run, name, value, 1_700_000_000_000, step)
        naive_s = (time.perf_counter() - started) / len(sample) * values
    print(f"parse {iterations} lines: {parse_s:.1f} s; batched {values / seconds:,.0f} "
          f"values/s; naive {values / naive_s:,.0f} values/s", file=sys.stderr, flush=True)
    print(json.dumps({"bench": "mlflow_logging", "records": values, "seconds": round(seconds, 2),
                      "naive_seconds": round(naive_s, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    # An iteration count as the one argument gives a quick, smaller run (not the figure).
    raise SystemExit(main(int(sys.argv[1]) if len(sys.argv) > 1 else ITERATIONS))
