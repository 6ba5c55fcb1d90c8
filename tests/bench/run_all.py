"""``make bench``: every benchmark, one JSON line each, ratios measured in the same run."""

from __future__ import annotations

import subprocess
import sys

BENCHES = ["tests.bench.bench_slurm", "tests.bench.bench_tokenize", "tests.bench.bench_trainer",
           "tests.bench.bench_mlflow", "tests.bench.bench_dag_parse", "tests.bench.bench_evaluate",
           "tests.bench.bench_campaign_load", "tests.bench.bench_goodput",
           "tests.bench.bench_deployment", "tests.bench.bench_scale"]
# Benches that need vLLM run in the cluster's job venv (the only one with vLLM's CPU build).
JOB_VENV_BENCHES = {"tests.bench.bench_evaluate"}


def interpreter(module: str) -> str:
    if module not in JOB_VENV_BENCHES:
        return sys.executable
    from tests.support import cluster

    return cluster.connection()["extra"]["remote_python"]


def main() -> int:
    failed = 0
    for module in BENCHES:
        proc = subprocess.run([interpreter(module), "-m", module], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
        if proc.returncode != 0 or not lines:
            failed += 1
            print(f'{{"bench": "{module}", "error": "exit {proc.returncode}"}}', flush=True)
            sys.stderr.write(proc.stderr[-3000:])
            continue
        for line in lines:
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
