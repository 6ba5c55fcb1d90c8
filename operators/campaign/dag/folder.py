"""The campaign folder -> one outcome per campaign file: its DAG, or the error naming it.

Each file builds or fails on its own, so one broken YAML never hides the valid campaigns.
Airflow 3.3's dag-processor parses Python files only and keeps one import error per parsed
file (and marks every DAG of a file that has one as stale), so a campaign has its own import
error only when it has its own DAG file. That is the shipped layout:

    dags/campaigns/x.yaml   the campaign
    dags/campaigns/x.py     its DAG file, the same two lines for every campaign (copy one):
                            builds ``pretrain__x`` from ``x.yaml``, or fails with the import
                            error ``campaigns/x.yaml:LINE: field: message``

A campaign with its own DAG file is named after it (``name: x``), so no two files define one
DAG. A YAML dropped in without one still works: ``dags/pretrain_campaigns.py`` builds every
campaign that has no DAG file of its own, and ``dags/pretrain_campaign_errors.py`` defines no
DAG and fails with one line per problem of those that do not build (one shared entry).

Files editors and tools leave beside the campaigns (``.#x.yaml`` locks, ``x.yaml~`` backups,
``.x.yaml.swp``, anything hidden, dangling links) are not campaigns and are skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.campaign.schema.load import CampaignConfigError, Problem, load_campaign
from operators.campaign.schema.naming import DAG_PREFIX

if TYPE_CHECKING:
    from airflow.sdk import DAG

log = logging.getLogger(__name__)
SUFFIXES = (".yaml", ".yml")
DAG_FILE_SUFFIX = ".py"


def is_campaign_file(path: Path) -> bool:
    """A campaign is a visible, regular ``*.yaml``/``*.yml`` file (links to one count)."""
    name = path.name
    if name.startswith((".", "#")) or name.endswith(("~", "#")):
        return False
    return name.endswith(SUFFIXES) and path.is_file()  # is_file: False for a dangling link


def campaign_files(campaign_dir: Path) -> list[Path]:
    return sorted(p for p in campaign_dir.iterdir() if is_campaign_file(p)) \
        if campaign_dir.is_dir() else []


def own_dag_file(path: Path) -> Path:
    """The campaign's own DAG file: ``x.py`` beside ``x.yaml``."""
    return path.with_suffix(DAG_FILE_SUFFIX)


def campaign_of_dag_file(dag_file: Path) -> Path:
    """``x.yaml`` (or ``x.yml``) beside the DAG file ``x.py``; ``x.yaml`` when neither is
    there, so the error names the file the user has to add."""
    for suffix in SUFFIXES:
        candidate = dag_file.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    return dag_file.with_suffix(SUFFIXES[0])


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


def _name_line(path: Path) -> int | None:
    """The line of the top-level ``name:`` key (the file has already been read as YAML)."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("name:"):
            return number
    return None


def build_own(path: Path, shown: str, register: bool = False) -> tuple[Any, DAG]:
    """:func:`build_one` for a campaign with its own DAG file: it must be named after it."""
    campaign, dag = build_one(path, shown, register)
    if campaign.name != path.stem:
        raise CampaignConfigError(shown, [Problem(
            "name", f"is {campaign.name!r}, but a campaign with its own DAG file "
                    f"({own_dag_file(path).name}) is named after its file: {path.stem!r}",
            _name_line(path))])
    return campaign, dag


def dag_file(dag_file_path: str, namespace: dict) -> DAG:
    """A campaign's own DAG file's part (``x.py`` beside ``x.yaml``): the DAG in its globals,
    or :class:`CampaignConfigError` naming ``campaigns/x.yaml``, field and line, which the
    dag-processor records as this file's import error, and only this file's."""
    path = campaign_of_dag_file(Path(dag_file_path))
    shown = f"{path.parent.name}/{path.name}"
    if not path.is_file():
        raise CampaignConfigError(shown, [Problem(
            "", f"no campaign file beside the DAG file {Path(dag_file_path).name}")])
    _campaign, dag = build_own(path, shown, register=True)
    namespace[dag.dag_id] = dag
    return dag


def build_campaigns(campaign_dir: Path, *, register: bool = True) -> list[Outcome]:
    """Every campaign file of ``campaign_dir`` without a DAG file of its own, built or refused
    on its own. Errors name the file relative to the DAG folder (``campaigns/x.yaml``), as the
    UI shows DAG files."""
    outcomes: list[Outcome] = []
    files = campaign_files(campaign_dir)
    # A campaign with its own DAG file is pretrain__<its file's stem> (build_own).
    owners: dict[str, Path] = {f"{DAG_PREFIX}{p.stem}": p for p in files
                               if own_dag_file(p).is_file()}
    for path in files:
        if own_dag_file(path).is_file():
            continue
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
                         "DAGs are unaffected (give a campaign x.yaml its own DAG file x.py, "
                         "a copy of campaigns/demo.py, for an import error of its own):\n"
                         + "\n".join(lines))


def publish(campaign_dir: Path, namespace: dict) -> list[DAG]:
    """The folder DAG file's part: the DAGs that build, in its globals; the others are
    logged (and raised by :func:`raise_errors`)."""
    dags = []
    for outcome in build_campaigns(campaign_dir):
        if outcome.dag is None:
            log.error("campaign skipped: %s", outcome.error)
            continue
        namespace[outcome.dag.dag_id] = outcome.dag
        dags.append(outcome.dag)
    return dags


def raise_errors(campaign_dir: Path) -> None:
    """The error DAG file's part: builds (unregistered) what the folder DAG file builds, and
    raises :class:`CampaignFolderError` when a campaign does not, so the UI lists it."""
    errors = [o.error for o in build_campaigns(campaign_dir, register=False) if o.error]
    if errors:
        raise CampaignFolderError(errors)
