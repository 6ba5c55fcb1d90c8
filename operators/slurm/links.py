"""Extra links on Slurm task instances: the job, and its log (tracking/links.py adds the
MLflow run's on the same base).

Airflow 3 shows a link by reading the XCom stored under the link's
``xcom_key``; the operator pushes the full URL there before it defers, so the
link is live while the job runs.
"""

from __future__ import annotations

from airflow.sdk import BaseOperatorLink


def job_url(settings, job_id: str) -> str:
    template = settings.log_url_template
    if template:
        return template.format(job_id=job_id, path="", host=settings.host)
    return f"slurm://{settings.host}/job/{job_id}"


def log_url(settings, job_id: str, path: str) -> str:
    template = settings.log_url_template
    if template:
        return template.format(job_id=job_id, path=path, host=settings.host)
    return f"sftp://{settings.user}@{settings.host}{path}"


class XComLink(BaseOperatorLink):
    """A link whose URL the task pushed to XCom under the link's ``xcom_key``."""

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.bases.xcom import BaseXCom

        try:
            return BaseXCom.get_value(ti_key=ti_key, key=self.xcom_key) or ""
        except Exception:  # noqa: BLE001 - a missing link must not break the page
            return ""


class SlurmJobLink(XComLink):
    name = "Slurm job"


class SlurmLogLink(XComLink):
    name = "Slurm log"
