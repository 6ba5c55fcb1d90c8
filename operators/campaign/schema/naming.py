"""A campaign's name in Airflow: its DAG id, ``pretrain__<name>``. The one definition (the DAG
factory, the scheduler's listener and ``make demo`` use it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

DAG_PREFIX = "pretrain__"


def dag_id(campaign: Campaign) -> str:
    return f"{DAG_PREFIX}{campaign.name}"


def campaign_of_dag(dag_id: str) -> str | None:
    """The campaign a DAG id belongs to; None for a DAG that is not a campaign's."""
    name = dag_id[len(DAG_PREFIX):] if dag_id.startswith(DAG_PREFIX) else ""
    return name or None
