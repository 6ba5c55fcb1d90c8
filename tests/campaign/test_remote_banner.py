"""The data-file check (``remote.missing_files``) through a login shell that prints a banner
on stdout: the banner is not a missing file, and an answer cut short is an error.

The cluster test changes the cluster user's shell file: run it under
``flock -x /tmp/pp-cluster.lock``; ``login_banner`` restores the file.
"""

from __future__ import annotations

import posixpath
import uuid

import pytest

from operators.campaign.adapters.remote import (
    missing_files,
    missing_files_command,
    read_missing_files,
)
from tests.support import cluster

PATHS = ["/home/pretrain/pp-missing-rec/has data.bin", "/home/pretrain/pp-missing-rec/empty.idx",
         "/home/pretrain/pp-missing-rec/absent.bin"]
MARKER = "pp-missing-5f0c2a9e1b7d4c36"
# Recorded on the local cluster (2026-12-01): `missing_files_command(PATHS, MARKER)` run by
# tests.support.cluster.remote inside cluster.login_banner(), "has data.bin" holding one byte,
# "empty.idx" empty, "absent.bin" absent. The first line is the banner the shell printed.
RECORDED = ("=== Welcome to pp-local: maintenance Tue 08:00-12:00, quota 93% full | see "
            "/etc/motd ===\npp-missing-5f0c2a9e1b7d4c36 1\npp-missing-5f0c2a9e1b7d4c36 2\n"
            "pp-missing-5f0c2a9e1b7d4c36 end\n")


def test_banner_line_is_not_a_missing_file() -> None:
    # Old: every stdout line was a path, so the banner was reported as a missing file.
    assert read_missing_files(RECORDED, PATHS, MARKER) == PATHS[1:]


def test_every_file_present_through_a_banner() -> None:
    banner_only = RECORDED.splitlines()[0] + f"\n{MARKER} end\n"
    assert read_missing_files(banner_only, PATHS, MARKER) == []


def test_answer_cut_short_is_an_error_not_all_present() -> None:
    # The connection dropped mid-loop: files never checked must not count as present.
    with pytest.raises(RuntimeError, match="ended early"):
        read_missing_files(RECORDED.rsplit(MARKER, 1)[0], PATHS, MARKER)


def test_answer_naming_no_path_of_ours_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="unexpected answer line"):
        read_missing_files(f"{MARKER} 9\n{MARKER} end\n", PATHS, MARKER)


def test_another_calls_marker_is_not_an_answer() -> None:
    other = RECORDED.replace(MARKER, "pp-missing-0000000000000000").replace(
        "pp-missing-0000000000000000 end", f"{MARKER} end")
    assert read_missing_files(other, PATHS, MARKER) == []


def test_path_with_quote_and_newline_is_one_shell_word() -> None:
    command = missing_files_command(["/d/it's\nodd.bin"], MARKER)
    assert "'/d/it'\"'\"'s\nodd.bin'" in command



@pytest.mark.disruptive
def test_missing_files_through_the_login_banner_on_the_cluster(hook) -> None:
    root = posixpath.join("/home/pretrain/pp-missing", uuid.uuid4().hex)
    full, empty, absent = (posixpath.join(root, n) for n in ("a b.bin", "e.idx", "gone.bin"))
    hook.check(f"mkdir -p {root} && printf x > '{full}' && : > {empty}")
    try:
        with cluster.login_banner() as banner:
            assert banner in hook.run("true")[1]  # the shell really prints it, per command
            assert missing_files(hook, [full, empty, absent]) == [empty, absent]
            assert missing_files(hook, [full]) == []
    finally:
        hook.check(f"rm -rf {root}")
