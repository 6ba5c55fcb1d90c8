"""A production campaign's files, laid out on the local cluster for the tests that run its jobs:
a data prefix, a tokenizer, an image file, an HF cache with the recipe's config, and the
test-only apptainer stand-in in ``bin/`` (put ``bin/`` on the job's PATH)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.preflight.hf_home import write_hf_home

STANDIN_APPTAINER = Path(__file__).parent / "standins" / "apptainer"


def lay_out(root: Path, prefix: Path) -> None:
    """A fresh ``root`` holding ``prefix``.bin/.idx, tokenizer/, nemo.sif, hf_home/ and
    bin/apptainer. The caller adds its own files, then hands ``root`` to the cluster user."""
    shutil.rmtree(root, ignore_errors=True)
    prefix.parent.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"\x00" * 64)
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    (root / "nemo.sif").write_bytes(b"")  # the stand-in checks that the image exists
    write_hf_home(root / "hf_home")
    (root / "bin").mkdir()
    shutil.copy(STANDIN_APPTAINER, root / "bin" / "apptainer")
    (root / "bin" / "apptainer").chmod(0o755)
