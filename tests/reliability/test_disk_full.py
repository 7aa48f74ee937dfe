"""A filesystem that fills up under the disk tier (issue 16, item 7): a write that fails
with ENOSPC makes the tier evict its own least recently used records and retry; it
stays healthy, its effective budget follows the free space, and writes resume by
themselves when space comes back. The directory is a small tmpfs mounted for the test
(root only; skipped otherwise); another process's file takes the space mid-run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_support import (
    RECORD_BYTES,
    STORE_ONLY,
    ColdOracle,
    drive,
    random_prompts,
    store_of,
    tier,
    wait_until,
    wrong_outputs,
)
from scorecard import Scorecard

from engine import LLM
from tiers import disk as disk_module

pytestmark = pytest.mark.timeout(180)

FS_BYTES = 2 * 1024**2
ROOM_RECORDS = 6  # what the filesystem has room for while the hog holds the rest
PROMPTS = random_prompts(8, 100, seed=61)  # 3 records each: 24 records, 4x the room
MORE = random_prompts(8, 100, seed=62)
MAX_TOKENS = 4


@contextlib.contextmanager
def small_filesystem(path: Path) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(path)],
                             capture_output=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def test_a_full_filesystem_evicts_old_records_and_writes_resume_when_space_returns(
    model_path: str, cold: ColdOracle, tmp_path: Path, scorecard: Scorecard, monkeypatch: pytest.MonkeyPatch
):
    with small_filesystem(tmp_path / "fs") as fs:
        hog = fs / "hog"
        with LLM(model=model_path, **STORE_ONLY, kv_offload="disk", kv_offload_disk_path=str(fs / "kv")) as llm:
            engine = llm.engine
            # The tier looks at the free space when it first writes; then another process
            # takes all but ROOM_RECORDS records of it. The tier's view is out of date
            # (held so, here, until a write fails), so its next writes hit ENOSPC.
            monkeypatch.setattr(disk_module, "SPACE_CHECK_S", 3600.0)
            drive(engine, random_prompts(1, 100, seed=60), 1)
            assert store_of(engine).drain(30)
            held_before = tier(engine, "disk")["usage_bytes"]
            hog.write_bytes(bytes(free_bytes(fs) - ROOM_RECORDS * RECORD_BYTES))
            full = drive(engine, PROMPTS, MAX_TOKENS)
            assert store_of(engine).drain(30)
            while_full = tier(engine, "disk")
            monkeypatch.undo()  # the tier looks at the free space again every SPACE_CHECK_S
            hog.unlink()
            freed = time.monotonic()

            def recovered() -> bool:
                """Writes land past what the full filesystem held and the budget has
                followed the free space back up (a save is attempted every step while
                this is polled; the free space is re-read every SPACE_CHECK_S)."""
                drive(engine, random_prompts(1, 100, seed=int(time.monotonic() * 1e6)), 1)
                assert store_of(engine).drain(30)
                now = tier(engine, "disk")
                grew = now["usage_bytes"] > while_full["usage_bytes"] + 2 * RECORD_BYTES
                return grew and now["capacity_bytes"] > 4 * while_full["capacity_bytes"]

            wait_until(recovered, 30)
            recovery_s = time.monotonic() - freed
            after = drive(engine, MORE, MAX_TOKENS)
            assert store_of(engine).drain(30)
            disk = tier(engine, "disk")
    wrong = wrong_outputs(full.outputs, cold(model_path, PROMPTS, MAX_TOKENS))
    wrong += wrong_outputs(after.outputs, cold(model_path, MORE, MAX_TOKENS))
    scorecard.add(
        "disk", "filesystem full (ENOSPC), then space freed", requests=len(PROMPTS) + len(MORE), wrong_outputs=wrong,
        recovery_s=recovery_s, filesystem_bytes=FS_BYTES, held_before_bytes=held_before,
        free_while_full_bytes=ROOM_RECORDS * RECORD_BYTES,
        effective_budget_while_full_bytes=while_full["capacity_bytes"], usage_while_full_bytes=while_full["usage_bytes"],
        evictions_while_full=while_full["evictions"], writes_while_full=while_full["puts"],
        writes_refused_while_full=while_full["put_rejected"],
        health_while_full=while_full["health"], write_errors=disk["errors"],
        usage_after_bytes=disk["usage_bytes"], effective_budget_after_bytes=disk["capacity_bytes"],
    )
    assert wrong == 0
    assert while_full["health"] == "healthy" and while_full["errors"] == 0
    assert while_full["evictions"] > 0 and while_full["puts"] > ROOM_RECORDS
    room = held_before + (ROOM_RECORDS + 1) * RECORD_BYTES  # what the tier held, and the free space
    assert while_full["usage_bytes"] <= room  # what the full filesystem held of ours
    assert while_full["capacity_bytes"] < FS_BYTES // 4  # the budget follows the free space
    assert disk["health"] == "healthy" and disk["errors"] == 0
    assert disk["capacity_bytes"] > 4 * while_full["capacity_bytes"]
