"""The DAG's ``register`` step in a process that cannot see the cluster's files.

    python -m tests.export_eval.register_child ARGS_JSON

Run by tests/export_eval/test_on_cluster.py inside a mount namespace where the cluster user's
home is an empty tmpfs: the export directory exists only on the cluster side of the SSH
connection, as on a real cluster. ARGS_JSON: {"campaign": {...}, "iteration": N,
"evaluation": {...}}. Prints the registration as one JSON line.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys


def main(argv: list[str]) -> int:
    from operators.campaign.adapters.tracking import register
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.load import campaign_from_dict
    from operators.slurm.hook import SlurmHook

    args = json.loads(argv[0])
    campaign = campaign_from_dict(args["campaign"])
    layout = Layout.for_campaign(campaign)
    for path in (layout.hf_export, posixpath.dirname(layout.campaign_dir)):
        if os.path.exists(path):
            print(f"{path} is visible to this process: the test proves nothing", file=sys.stderr)
            return 2
    result = register(campaign, SlurmHook(campaign.cluster.ssh_conn_id), layout,
                      args["iteration"], args["evaluation"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
