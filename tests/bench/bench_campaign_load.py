"""Benchmark: reading broken and hostile campaign files (issue 14 §4).

Error reporting must stay linear and a DAG folder of broken campaigns must parse in well under
a second per file. Measured in one run, against the shipped demo campaign read the same way:

* ``load_campaign`` of files with N unknown keys (N = 1,000 and 4,000, under the section cap):
  ``per_key_growth`` is the cost per key at 4,000 over the cost per key at 1,000 (1.0 is linear);
* ``load_campaign`` of 40,000 unknown keys (refused at the cap), a list of 50,000 binds and a
  "billion laughs" of aliases;
* Airflow's DagBag over a folder holding each of those as a campaign with its own DAG file
  (what the dag-processor runs per file), ``dagbag_ms_per_file``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from operators.campaign.schema.load import CampaignConfigError, load_campaign
from tests.campaign.util import CAMPAIGNS, DEMO, dump, edited, raw

STUB = CAMPAIGNS / "demo.py"


def _unknown_keys(n: int) -> str:
    doc = raw(DEMO)
    doc["training"].update({f"unknown_{i}": i for i in range(n)})
    return dump(doc)


def _hostile() -> dict[str, str]:
    laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    return {
        "keys_1000": _unknown_keys(1000),
        "keys_4000": _unknown_keys(4000),
        "keys_40000": _unknown_keys(40_000),
        "binds_50000": dump(edited(raw(DEMO), {"cluster.container": {
            "image": "/images/x.sif", "binds": ["/a:/b"] * 50_000}})),
        "laughs": DEMO.read_text() + "\n".join(laughs) + "\n",
    }


def _load_ms(path: Path, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        with contextlib.suppress(CampaignConfigError):  # the files are broken on purpose
            load_campaign(path)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> dict:
    from airflow.dag_processing.dagbag import DagBag

    with tempfile.TemporaryDirectory() as tmp:
        campaigns = Path(tmp) / "dags" / "campaigns"
        campaigns.mkdir(parents=True)
        files = {}
        for name, text in _hostile().items():
            files[name] = campaigns / f"{name}.yaml"
            files[name].write_text(text)
            shutil.copy(STUB, campaigns / f"{name}.py")
        base = _load_ms(DEMO)
        load = {name: _load_ms(path) for name, path in files.items()}
        start = time.perf_counter()
        bag = DagBag(str(campaigns.parent), bundle_path=campaigns.parent)
        dagbag_ms = (time.perf_counter() - start) * 1000
        assert len(bag.import_errors) == len(files), bag.import_errors
    per_key = {n: load[f"keys_{n}"] / n for n in (1000, 4000)}
    return {"bench": "campaign_load", "baseline_demo_ms": round(base, 2),
            **{f"{name}_ms": round(ms, 1) for name, ms in load.items()},
            "per_key_growth": round(per_key[4000] / per_key[1000], 2),
            "ratio_keys_40000_vs_baseline": round(load["keys_40000"] / base, 1),
            "dagbag_ms_per_file": round(dagbag_ms / len(files), 1)}


if __name__ == "__main__":
    print(json.dumps(main()))
