"""Which job under a successor's key a segment takes for its pre-queued successor
(``prequeue.waits_for``), read from the script render.py writes: after its task was cleared,
the successor queued behind the cancelled job is on its way out (``--kill-on-invalid-dep``);
the new try queues its own."""

from __future__ import annotations

import pytest

from operators.campaign.dag import prequeue
from operators.slurm.messages import JobRequest
from operators.slurm.operator import build_spec
from operators.slurm.render import render_script

pytestmark = pytest.mark.pure


def _script(after_job: str) -> str:
    request = JobRequest("exec \"$PP_PYTHON\" -m jobscripts.reference_trainer", {"time": "5"})
    job = prequeue.gated(request, after_job, "/runs/pp-segment_1-abc", "/ck", 12)
    return render_script(build_spec("pp-segment_2-def", "/runs/pp-segment_2-def",
                                    job.command, job.job))


def test_a_successor_is_this_chains_only_behind_this_job() -> None:
    assert prequeue.waits_for(_script("4711"), "4711")
    assert not prequeue.waits_for(_script("4711"), "4712")  # the cleared try's successor
    assert not prequeue.waits_for(_script("47111"), "4711")  # the whole id, not a prefix
    plain = render_script(build_spec("k", "/r", "echo hi", {"time": "5"}))
    assert not prequeue.waits_for(plain, "4711")
