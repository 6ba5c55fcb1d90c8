"""The campaign folder -> one outcome per campaign file: its DAG, or the error naming it.

Each file builds or fails on its own, so one broken YAML never hides the valid campaigns.
Airflow keeps import errors per DAG *file*, and marks every DAG of a file that has one as
stale (gone from the UI), so the two are reported by two DAG files that run this same code:

    dags/pretrain_campaigns.py        the DAGs of the campaigns that build
    dags/pretrain_campaign_errors.py  no DAGs; raises one error listing every campaign that
                                      does not, as ``campaigns/x.yaml:LINE: field: message``

Files editors and tools leave beside the campaigns (``.#x.yaml`` locks, ``x.yaml~`` backups,
``.x.yaml.swp``, anything hidden, dangling links) are not campaigns and are skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.campaign.schema.load import CampaignConfigError, Problem, load_campaign

if TYPE_CHECKING:
    from airflow.sdk import DAG

log = logging.getLogger(__name__)
SUFFIXES = (".yaml", ".yml")


def is_campaign_file(path: Path) -> bool:
    """A campaign is a visible, regular ``*.yaml``/``*.yml`` file (links to one count)."""
    name = path.name
    if name.startswith((".", "#")) or name.endswith(("~", "#")):
        return False
    return name.endswith(SUFFIXES) and path.is_file()  # is_file: False for a dangling link


def campaign_files(campaign_dir: Path) -> list[Path]:
    return sorted(p for p in campaign_dir.iterdir() if is_campaign_file(p)) \
        if campaign_dir.is_dir() else []


@dataclass(frozen=True)
class Outcome:
    path: Path
    dag: DAG | None = None
    error: CampaignConfigError | None = None


def build_one(path: Path, shown: str, register: bool = False) -> tuple[Any, DAG]:
    """(campaign, DAG) of one file; raises :class:`CampaignConfigError` naming ``shown``."""
    from operators.campaign.dag.dag_factory import build_dag

    try:
        campaign = load_campaign(path)
    except CampaignConfigError as exc:
        raise CampaignConfigError(shown, exc.problems) from None
    try:
        return campaign, build_dag(campaign, path, auto_register=register)
    except Exception as exc:  # noqa: BLE001 - any failure of one campaign is that campaign's
        raise CampaignConfigError(shown, [Problem("", f"its DAG cannot be built: "
                                                      f"{type(exc).__name__}: {exc}")]) from None


def build_campaigns(campaign_dir: Path, *, register: bool = True) -> list[Outcome]:
    """Every campaign file of ``campaign_dir``, built or refused on its own. Errors name the
    file relative to the DAG folder (``campaigns/x.yaml``), as the UI shows DAG files."""
    outcomes: list[Outcome] = []
    owners: dict[str, Path] = {}
    for path in campaign_files(campaign_dir):
        shown = f"{campaign_dir.name}/{path.name}"
        try:
            _campaign, dag = build_one(path, shown, register)
        except CampaignConfigError as exc:
            outcomes.append(Outcome(path, error=exc))
            continue
        if dag.dag_id in owners:
            outcomes.append(Outcome(path, error=CampaignConfigError(shown, [Problem(
                "name", f"{dag.dag_id} is already defined by {owners[dag.dag_id].name}")])))
            continue
        owners[dag.dag_id] = path
        outcomes.append(Outcome(path, dag=dag))
    return outcomes


class CampaignFolderError(ValueError):
    """Campaign files that cannot be used, one ``file:line: field: message`` per problem."""

    def __init__(self, errors: list[CampaignConfigError]) -> None:
        self.errors = errors
        lines = [p.located(e.path) for e in errors for p in e.problems]
        super().__init__(f"{len(errors)} campaign file(s) cannot be used; the other campaigns' "
                         "DAGs are unaffected:\n" + "\n".join(lines))


def publish(campaign_dir: Path, namespace: dict) -> list[DAG]:
    """The DAG file's part: the DAGs that build, in its globals; the others are logged."""
    dags = []
    for outcome in build_campaigns(campaign_dir):
        if outcome.dag is None:
            log.error("campaign skipped: %s", outcome.error)
            continue
        namespace[outcome.dag.dag_id] = outcome.dag
        dags.append(outcome.dag)
    return dags


def raise_errors(campaign_dir: Path) -> None:
    """The error DAG file's part: builds (unregistered) what the other file builds, and
    raises :class:`CampaignFolderError` when a campaign does not, so the UI lists it."""
    errors = [o.error for o in build_campaigns(campaign_dir, register=False) if o.error]
    if errors:
        raise CampaignFolderError(errors)
