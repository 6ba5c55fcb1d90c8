"""Benchmark: time to parse ``dags/`` with 3 campaigns, as the dag-processor does (issue 6 §7).

Airflow itself is imported first (the dag-processor has it loaded); then the DAG file is
executed in a fresh module namespace. The baseline is a one-task DAG file parsed the same way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import runpy, sys, time
import airflow.sdk  # loaded in the dag-processor before any DAG file
t = time.perf_counter()
runpy.run_path(sys.argv[1])
print((time.perf_counter() - t) * 1000)
"""
BASELINE_DAG = """
from datetime import datetime
from airflow.sdk import DAG
from airflow.providers.standard.operators.empty import EmptyOperator
with DAG("baseline", schedule=None, start_date=datetime(2026, 1, 1)):
    EmptyOperator(task_id="t")
"""


def parse_ms(dag_file: Path) -> float:
    runs = [float(subprocess.run([sys.executable, "-c", PROBE, str(dag_file)], check=True,
                                 capture_output=True, text=True).stdout.split()[-1])
            for _ in range(3)]
    return min(runs)


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "dags"
        shutil.copytree(REPO / "dags", folder)
        demo = (folder / "campaigns" / "demo.yaml").read_text()
        (folder / "campaigns" / "demo_copy.yaml").write_text(
            demo.replace("name: demo", "name: demo_copy"))
        campaigns = len(list((folder / "campaigns").glob("*.yaml")))
        baseline = Path(tmp) / "baseline_dag.py"
        baseline.write_text(BASELINE_DAG)
        total = parse_ms(folder / "pretrain_campaigns.py")
        base = parse_ms(baseline)
    return {"bench": "dag_parse", "campaigns": campaigns, "total_ms": round(total, 1),
            "baseline_one_task_dag_ms": round(base, 1), "ratio_vs_baseline": round(total / base, 1)}


if __name__ == "__main__":
    print(json.dumps(main()))
