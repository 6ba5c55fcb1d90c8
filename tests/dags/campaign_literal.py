"""An Airflow DAG of a campaign whose environment holds Jinja, as a hostile campaign file would
(tests/campaign/test_template_injection.py): built by the real DAG factory."""

from __future__ import annotations

from pathlib import Path

import yaml

from operators.campaign.dag.dag_factory import build_dag
from operators.campaign.schema.load import campaign_from_dict

ROOT = "/home/pretrain/pp-test-literal"
# Each would render to something else: 49, a connection's password, a Variable, a '$'.
HOSTILE_ENVIRONMENT = {
    "NCCL_DEBUG": "{{ 7*7 }}",
    "FROM_CONN": "{{ conn.pp_literal_conn.password }}",
    "FROM_VAR": "{{ var.value.get('pp_literal_var', 'absent') }}",
    "DOLLAR": "{{ '%c' % 36 }}(id)",
    "BLOCK": "{% for x in [1, 2] %}{{ x }}{% endfor %}",
}


def _campaign():
    raw = yaml.safe_load((Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml")
                         .read_text())
    raw["name"] = "literal_env"
    raw["cluster"]["remote_root"] = ROOT
    raw["cluster"]["environment"] = HOSTILE_ENVIRONMENT
    return campaign_from_dict(raw)


dag = build_dag(_campaign())
