"""The exported Hugging Face directory, fetched from the cluster over SFTP for registration.

Registration runs on the Airflow side, and Airflow's machines need not see the cluster's file
system. What to fetch is the export job's listing (``<export dir>.export.json``, written by
jobscripts/export_hf.py after it published the directory): the names and sizes of the files
it verified. Only those files of the export directory are read, never the checkpoint, and a
name outside what a Hugging Face model directory holds (config, tokenizer, safetensors) is
refused rather than fetched. Each file is streamed in chunks, one hook read per chunk (the
hook retries a dropped connection), into a temporary directory, and must have exactly the
listed size: a listing left from an earlier export, or a short read, fails the registration
instead of registering a broken model.
"""

from __future__ import annotations

import contextlib
import posixpath
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jobscripts.export_hf import LISTING_SUFFIX

if TYPE_CHECKING:
    from operators.slurm.hook import SlurmHook

# Per hook read. paramiko serves one large read() in 32 KiB requests and slows down with the
# read's size: measured over the local sshd, 32 MiB reads gave 1.5 MiB/s, 128 KiB-1 MiB reads
# 7-15 MiB/s even with a new SFTP session per read.
CHUNK_BYTES = 512 << 10
# What jobscripts/export_hf.py publishes: configs, tokenizer files, weights.
ALLOWED_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")


class ExportFetchError(RuntimeError):
    """The export on the cluster is missing, failed, or does not match its listing."""


def read_listing(hook: SlurmHook, export_dir: str, iteration: int | None = None) -> dict[str, int]:
    """``{file name: bytes}`` of the published export, checked before anything is fetched."""
    path = export_dir + LISTING_SUFFIX
    listing = hook.read_json(path)
    if listing is None:
        raise ExportFetchError(f"{path} does not exist: the export job never finished")
    if not listing.get("ok"):
        raise ExportFetchError(f"{path}: the last export failed: {listing.get('error')}")
    if iteration is not None and listing.get("iteration") != iteration:
        raise ExportFetchError(f"{path}: the export is of iteration {listing.get('iteration')}, "
                               f"not {iteration}: export again before registering")
    files = listing.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        raise ExportFetchError(f"{path}: lists no config.json (not a Hugging Face export)")
    for name, size in files.items():
        if "/" in name or name.startswith(".") or not name.endswith(ALLOWED_SUFFIXES):
            raise ExportFetchError(f"{path}: {name!r} is not a file of a Hugging Face model "
                                   "directory; refusing to fetch it")
        if not isinstance(size, int) or size < 0:
            raise ExportFetchError(f"{path}: size of {name!r} is {size!r}")
    return files


def fetch_file(hook: SlurmHook, remote: str, local: Path, size: int) -> None:
    with open(local, "wb") as handle:
        offset = 0
        while offset < size:
            data = hook.read_bytes(remote, offset, min(CHUNK_BYTES, size - offset))
            if not data:
                raise ExportFetchError(f"{remote}: {offset} bytes, the export's listing says "
                                       f"{size} (changed since it was exported?)")
            handle.write(data)
            offset += len(data)
    if hook.read_bytes(remote, size, 1):
        raise ExportFetchError(f"{remote} is longer than the {size} bytes its listing says "
                               "(changed since it was exported?)")


@dataclass
class ClusterExport:
    """The export directory on the cluster, as registry.register_model's ExportSource."""

    hook: object  # operators.slurm.hook.SlurmHook
    path: str
    iteration: int | None = None  # the listing must say this iteration

    @property
    def location(self) -> str:
        return self.path

    @contextlib.contextmanager
    def local_copy(self) -> Iterator[Path]:
        files = read_listing(self.hook, self.path, self.iteration)
        with tempfile.TemporaryDirectory(prefix="pp-export-") as tmp:
            for name, size in sorted(files.items()):
                fetch_file(self.hook, posixpath.join(self.path, name), Path(tmp) / name, size)
            yield Path(tmp)
