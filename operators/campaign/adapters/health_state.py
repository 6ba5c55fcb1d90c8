"""The campaign's health state on the cluster: the hold a flagged segment leaves, and a real
rollback (docs/health.md).

    <campaign>/health/hold.json          a segment's loss spike or NaN steps: the campaign
                                         trains no further segment while it is there
    <campaign>/health/skip.json          batches to skip after a rollback (iterations_to_skip)
    <campaign>/health/set_aside/<N>/     checkpoints after the one rolled back to, kept (not
                                         deleted) until the campaign has passed the spike;
                                         its set_aside.json says until which iteration
    <campaign>/health/removed.jsonl      each set-aside folder removed, and why

A rollback moves the checkpoint tracker back to a chosen earlier complete checkpoint, moves
every later ``iter_*`` folder aside (one ``mv`` each: same filesystem, no copy), and records
the K batches to skip, which the next segment's trainer config gets as Megatron's
``iterations_to_skip`` (operators/campaign/dag/health.py renders it).

The set-aside checkpoints are the way back should the rollback itself prove wrong; once the
campaign has saved a checkpoint past the spike and past every checkpoint set aside, in a
segment no watcher flagged, the rolled-back branch can no longer be the better one to resume
from, and its folder is removed (:func:`remove_passed`; docs/health.md, "set-aside").
"""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import TYPE_CHECKING, Any

from jobscripts import checkpoints
from jobscripts.job_files import ITER_DIR_RE
from operators.campaign.adapters.remote import (
    read_history,
    read_iteration,
    read_text,
    write_file,
)

if TYPE_CHECKING:
    from operators.campaign.render.layout import Layout
    from operators.slurm.hook import SlurmHook

HEALTH_DIR = "health"
HOLD_FILE = "hold.json"
SKIP_FILE = "skip.json"
SET_ASIDE = "set_aside"
SET_ASIDE_RECORD = "set_aside.json"  # in each set_aside/<N>/: what it holds, kept until when
REMOVED_LOG = "removed.jsonl"


def health_dir(layout: Layout) -> str:
    return posixpath.join(layout.campaign_dir, HEALTH_DIR)


def hold_path(layout: Layout) -> str:
    return posixpath.join(health_dir(layout), HOLD_FILE)


def skip_path(layout: Layout) -> str:
    return posixpath.join(health_dir(layout), SKIP_FILE)


def read_hold(hook: SlurmHook, layout: Layout) -> dict[str, Any] | None:
    text = read_text(hook, hold_path(layout))
    return json.loads(text) if text else None


def write_hold(hook: SlurmHook, layout: Layout, hold: dict[str, Any]) -> None:
    write_file(hook, hold_path(layout), json.dumps(hold, indent=1, sort_keys=True) + "\n")


def clear_hold(hook: SlurmHook, layout: Layout, decision: dict[str, Any]) -> None:
    """The hold is answered: kept as ``hold.<iteration>.json`` with the decision, for the
    record, and the campaign may train again."""
    hold = read_hold(hook, layout) or {}
    done = posixpath.join(health_dir(layout), f"hold.{hold.get('iteration', 'x')}.json")
    write_file(hook, done, json.dumps({**hold, "decision": decision}, indent=1,
                                      sort_keys=True) + "\n")
    hook.check(f"rm -f -- {shlex.quote(hold_path(layout))}")


def complete_checkpoints(hook: SlurmHook, layout: Layout) -> list[int]:
    """The iterations of the checkpoint folders on the cluster, oldest first."""
    out = hook.check(f"ls -1 -- {shlex.quote(layout.checkpoints)} 2>/dev/null || true")
    found = (ITER_DIR_RE.match(line.strip()) for line in out.splitlines())
    return sorted(int(m.group(1)) for m in found if m)


def skip_list(skip: dict[str, Any] | None, bridge: bool) -> list[int]:
    """``skip.json`` as the trainer's ``iterations_to_skip``: K batches after a resume from N.
    The reference trainer (Megatron-LM's rule) names the step by the iterations done before
    it, N .. N+K-1; Megatron Bridge (``train.iterations_to_skip``, ``step + 1 in ...`` in
    megatron/bridge/training/train.py) by the step's own number, N+1 .. N+K. Pure."""
    if not skip:
        return []
    start, count = int(skip["from_iteration"]), int(skip["batches"])
    first = start + 1 if bridge else start
    return list(range(first, first + count))


def kept_until(to_iteration: int, spike_iteration: int | None, set_aside: list[int]) -> int:
    """The iteration a rollback's set-aside checkpoints are kept until: the campaign must
    have saved a checkpoint beyond it (beyond the spike and every checkpoint set aside). Pure."""
    return max([to_iteration, spike_iteration or 0, *set_aside])


def passed(record: dict[str, Any], iteration: int) -> bool:
    """Whether a campaign at ``iteration`` (its tracker, after a segment no watcher flagged)
    has passed the spike of the rollback ``record`` (a set_aside.json) describes. Pure."""
    return iteration > int(record["until"])


def _free_aside_dir(hook: SlurmHook, layout: Layout, to_iteration: int) -> str:
    """``set_aside/<N>``, or ``<N>.2``, ``<N>.3``... when an earlier rollback to N left one
    (a second mv into an existing folder would nest the checkpoints, not keep them apart)."""
    root = posixpath.join(health_dir(layout), SET_ASIDE)
    taken = set(hook.check(f"ls -1 -- {shlex.quote(root)} 2>/dev/null || true").split())
    name, k = str(to_iteration), 1
    while name in taken:
        k += 1
        name = f"{to_iteration}.{k}"
    return posixpath.join(root, name)


def rollback(hook: SlurmHook, layout: Layout, to_iteration: int, batches: int,
             spike_iteration: int | None = None) -> dict:
    """Move the tracker back to ``to_iteration``, later checkpoints aside, and record the
    ``batches`` to skip from there. ``spike_iteration``: the finding's, which the campaign
    must pass before the set-aside checkpoints are removed. Raises ``ValueError`` naming
    what is wrong."""
    available = complete_checkpoints(hook, layout)
    if to_iteration not in available:
        raise ValueError(f"rollback: no checkpoint at iteration {to_iteration} in "
                         f"{layout.checkpoints} (there are {available})")
    if batches < 0:
        raise ValueError(f"rollback: batches to skip must be >= 0 (got {batches})")
    later = [i for i in available if i > to_iteration]
    aside = _free_aside_dir(hook, layout, to_iteration)
    record = {"rolled_back_to": to_iteration, "spike_iteration": spike_iteration,
              "checkpoints": later, "until": kept_until(to_iteration, spike_iteration, later)}
    moves = [f"mv -- {shlex.quote(checkpoints.checkpoint_dir(layout.checkpoints, i).as_posix())}"
             f" {shlex.quote(aside)}/" for i in later]
    hook.check(" && ".join([f"mkdir -p -- {shlex.quote(aside)}", *moves]))
    write_file(hook, posixpath.join(aside, SET_ASIDE_RECORD),
               json.dumps(record, sort_keys=True) + "\n")  # one line: read_set_aside
    write_file(hook, layout.tracker, str(to_iteration))  # Megatron writes no newline
    skip = {"from_iteration": to_iteration, "batches": batches, "set_aside": later,
            "set_aside_dir": aside, "spike_iteration": spike_iteration,
            "kept_until": record["until"]}
    write_file(hook, skip_path(layout), json.dumps(skip, sort_keys=True) + "\n")
    return skip


def read_skip(hook: SlurmHook, layout: Layout) -> dict[str, Any] | None:
    text = read_text(hook, skip_path(layout))
    return json.loads(text) if text else None


def read_set_aside(hook: SlurmHook, layout: Layout) -> dict[str, dict[str, Any]]:
    """Each set-aside folder -> its record (one SSH command for all of them)."""
    root = posixpath.join(health_dir(layout), SET_ASIDE)
    out = hook.check(f"for f in {shlex.quote(root)}/*/{SET_ASIDE_RECORD}; do "
                     "[ -f \"$f\" ] && printf '%s\\t%s\\n' \"${f%/*}\" \"$(cat -- \"$f\")\"; "
                     "done; true")
    found = {}
    for line in out.splitlines():
        folder, sep, text = line.partition("\t")
        if sep and text.strip():
            found[folder] = json.loads(text)
    return found


def remove_passed(hook: SlurmHook, layout: Layout, iteration: int,
                  **context: Any) -> list[dict[str, Any]]:
    """Remove the set-aside folders whose spike the campaign, now at ``iteration`` after a
    segment no watcher flagged, has passed; each removal is appended to ``removed.jsonl``
    with ``context`` (run, segment). Returns what was removed."""
    gone = [{**record, "set_aside_dir": folder, "removed_at_iteration": iteration, **context}
            for folder, record in sorted(read_set_aside(hook, layout).items())
            if passed(record, iteration)]
    if gone:
        hook.check(" && ".join(f"rm -rf -- {shlex.quote(g['set_aside_dir'])}" for g in gone))
        path = posixpath.join(health_dir(layout), REMOVED_LOG)
        write_file(hook, path, (read_text(hook, path) or "") + "".join(
            json.dumps(g, sort_keys=True) + "\n" for g in gone))
    return gone


# Where a segment's watcher finds its baseline: the job logs of the last few segments, read
# from their ends (a few thousand iteration lines each).
BASELINE_SEGMENTS = 3
BASELINE_LOG_BYTES = 256 << 10


def loss_baseline(hook: SlurmHook, layout: Layout, window: int,
                  up_to: int | None = None) -> list[tuple[int, float]]:
    """The last ``window`` (iteration, lm loss) pairs the campaign logged up to iteration
    ``up_to`` (default: where its tracker stands; after a rollback, the checkpoint it went
    back to), from the newest segments' job logs (``segments.jsonl``'s ``log_path``). A
    segment's spike watcher starts from them: without them it could not judge a segment's
    first ``window`` iterations, and a spike right after a resume went by unflagged under
    the real scheduler (segments of 2 iterations, window 3)."""
    from operators.tracking.health import baseline_losses

    iteration = read_iteration(hook, layout) if up_to is None else up_to
    merged: dict[int, float] = {}
    for record in reversed(read_history(hook, layout)[-BASELINE_SEGMENTS:]):
        if len(merged) >= window:
            break
        if not record.get("log_path") or record.get("start_iteration", 0) >= iteration:
            continue  # no log, or trained wholly past that iteration (before a rollback)
        # The first line of a tail may be cut: dropped.
        lines = hook.log_tail(record["log_path"], BASELINE_LOG_BYTES).splitlines()[1:]
        for it, loss in baseline_losses(lines, iteration, window):
            merged.setdefault(it, loss)  # a newer segment's redone iteration wins
    return sorted(merged.items())[-window:]
