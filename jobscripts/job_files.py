"""The files a job leaves on the cluster, by name and pattern: the one definition.

Jobs (jobscripts/) write them; the Airflow side (operators/) finds, reads and uploads them. The
package is installed on both sides and this module imports nothing but ``re``, so both may use
it. What each file holds is described in docs/contracts.md.

In a job's run directory (its working directory, ``SlurmHook.run_dir(key)``):

    result.json       every stage job's result (jobscripts/common.py's entry_point)
    segment.json      a training segment's result (reference trainer, Bridge recorder)

Under a checkpoint root (Megatron's layout; the reference trainer writes the same):

    latest_checkpointed_iteration.txt   the tracker: the last complete iteration, "50"
    iter_0000050/                       one directory per saved iteration, 7+ digits
    iter_0000050/complete.json          the reference trainer's end-of-save marker
    .reference-faults.json              TEST-ONLY faults the CPU reference trainer injects
                                        (jobscripts/trainer_faults.py); never in production

In a tokenized data directory: ``manifest.json`` (jobscripts/manifest.py), written last.
"""

from __future__ import annotations

import re

RESULT_FILE = "result.json"
SEGMENT_RESULT = "segment.json"
MANIFEST_FILE = "manifest.json"

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "complete.json"
# Beside the tracker: which live job may write the checkpoints (checkpoints.py's fencing).
CHECKPOINT_LEASE = ".checkpoint-lease.json"
# Beside the tracker: the last iteration trained (saved or not), so a resumed run can count
# the iterations it trains a second time.
TRAINING_PROGRESS = ".training-progress.json"
# Test-only: the faults a test asks the CPU reference trainer to inject (trainer_faults.py).
REFERENCE_FAULTS = ".reference-faults.json"
# Megatron formats f"iter_{iteration:07d}": seven digits, more past iteration 9,999,999.
ITER_DIR_FORMAT = "iter_{:07d}"
ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")

