"""Disk faults under the engine (disk tier only, no device prefix cache): damaged and
foreign records under valid names, a read-only directory, a budget smaller than the
working set, SIGKILL in the middle of writes. No bad record is ever used (outputs equal
the cold run's), every one is counted, and what was fully written is found again."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from reliability_support import (
    CHUNK,
    RECORD_BYTES,
    STORE_ONLY,
    ColdOracle,
    Run,
    bytes_on_disk,
    delta,
    drive,
    engine_codec,
    invalid_disk_records,
    last_json,
    missing_chunks,
    numeric_stats,
    random_prompts,
    record_files,
    rejected,
    spawn,
    store_of,
    temp_files,
    tier,
    without_dac_override,
    wrong_outputs,
)
from scorecard import Scorecard

from engine import LLM
from kvstore.record import HEADER_SIZE

pytestmark = pytest.mark.timeout(240)

PROMPTS = random_prompts(6, 100, seed=21)
MAX_TOKENS = 4
LOADABLE = len(PROMPTS) * (100 - 1) // CHUNK * CHUNK
CHUNKS = LOADABLE // CHUNK
VERSION_OFFSET = 4  # magic "KVTR", then the u16 format version
BLOCKS_OFFSET = 10  # u16 number of blocks (kvstore.record)
# header fields (magic, version, flags, dtype, rank, fingerprint, block hash, shape,
# lengths, checksum), the payload, and the last byte
FLIP_AT = (0, 4, 6, 8, 9, 12, 44, 80, 108, 116, 124, HEADER_SIZE + 7, -1)
KILL_CYCLES = 1
REPLAYED = 6  # prompts replayed after the restart (all of them are looked up)
CATCH_WRITE_S = 60.0  # how long to hunt for an instant when a record is half written


def disk_engine(model: str, path: Path, **options: object) -> LLM:
    return LLM(model=model, **STORE_ONLY, kv_offload="disk", kv_offload_disk_path=str(path), **options)


def fill(model: str, path: Path, prompts: list[list[int]] = PROMPTS) -> list[Path]:
    """Serve `prompts` once; closing the engine writes out every record."""
    with disk_engine(model, path) as llm:
        drive(llm.engine, prompts, MAX_TOKENS)
    return record_files(path)


def flip(path: Path, index: int) -> None:
    data = bytearray(path.read_bytes())
    data[FLIP_AT[index % len(FLIP_AT)]] ^= 0x40
    path.write_bytes(data)


def truncate(path: Path, index: int) -> None:
    size = path.stat().st_size
    cuts = (0, 1, 64, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1000, size - 1)
    os.truncate(path, cuts[index % len(cuts)])


def as_format_version_3(path: Path, _: int) -> None:
    """A well-formed record (valid checksums) of a format version this build cannot read."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, VERSION_OFFSET, 3)
    (blocks,) = struct.unpack_from("<H", data, BLOCKS_OFFSET)
    hashes = bytes(data[HEADER_SIZE : HEADER_SIZE + 32 * blocks])
    digest = xxhash.xxh3_64(bytes(data[: HEADER_SIZE - 8]) + hashes)  # the head checksum
    struct.pack_into("<Q", data, HEADER_SIZE - 8, digest.intdigest())
    path.write_bytes(data)


class Replay:
    """A fresh engine on a damaged directory: the damaged round, then rounds until the
    store serves every chunk again (at most three)."""

    def __init__(self, model: str, path: Path, cold: list[list[int]]) -> None:
        self.runs: list[Run] = []
        self.counters: list[dict[str, float]] = []
        with disk_engine(model, path) as llm:
            for _ in range(3):
                self._round(llm)
                assert store_of(llm.engine).drain(30)
                if self.counters[-1]["kv_loaded_tokens"] == LOADABLE:
                    break
            self.disk = tier(llm.engine, "disk")
            self.invalid = invalid_disk_records(engine_codec(llm.engine), path)
        self.wrong = sum(wrong_outputs(r.outputs, cold) for r in self.runs)

    def _round(self, llm: LLM) -> None:
        before = numeric_stats(llm.engine)
        self.runs.append(drive(llm.engine, PROMPTS, MAX_TOKENS))
        self.counters.append(delta(before, numeric_stats(llm.engine)))


def damage_and_replay(
    model: str, path: Path, cold: list[list[int]], damage: Callable[[Path, int], None]
) -> tuple[int, Replay]:
    files = fill(model, path)
    assert len(files) == CHUNKS
    for index, file in enumerate(files):
        damage(file, index)
    return len(files), Replay(model, path, cold)


@pytest.mark.parametrize(
    ("name", "damage"),
    [("flipped bytes", flip), ("truncated records", truncate),
     ("format version 3 records", as_format_version_3)],
)
def test_damaged_records_are_rejected_and_replaced(
    name: str, damage: Callable[[Path, int], None], model_path: str, cold: ColdOracle,
    tmp_path: Path, scorecard: Scorecard,
):
    damaged, replay = damage_and_replay(model_path, tmp_path, cold(model_path, PROMPTS, MAX_TOKENS), damage)
    record_damaged_scenario(scorecard, name, damaged, replay)


def test_records_of_another_model_under_valid_names_are_rejected(
    model_path: str, other_model_path: str, cold: ColdOracle, tmp_path: Path, scorecard: Scorecard
):
    foreign = fill(other_model_path, tmp_path / "other")
    assert len(foreign) == CHUNKS

    def replace_with_foreign(path: Path, index: int) -> None:
        path.write_bytes(foreign[index].read_bytes())

    want = cold(model_path, PROMPTS, MAX_TOKENS)
    damaged, replay = damage_and_replay(model_path, tmp_path / "ours", want, replace_with_foreign)
    record_damaged_scenario(scorecard, "another model's records", damaged, replay)


def record_damaged_scenario(scorecard: Scorecard, name: str, damaged: int, replay: Replay) -> None:
    first = replay.counters[0]
    scorecard.add(
        "disk", name, requests=sum(len(r.ids) for r in replay.runs), wrong_outputs=replay.wrong,
        faults=damaged, torn_records=len(replay.invalid), damaged_records=damaged,
        rejected_records=rejected(replay.disk), loaded_tokens_damaged_round=first["kv_loaded_tokens"],
        rounds_until_all_served_again=len(replay.runs) - 1,
    )
    assert replay.wrong == 0
    # every damaged record is refused once: when the disk scan reads its head, or when a
    # load reads it whole (damage past the head)
    assert first["kv_loaded_tokens"] == 0
    assert rejected(replay.disk) == damaged
    assert replay.counters[-1]["kv_loaded_tokens"] == LOADABLE
    assert replay.invalid == []


def test_read_only_directory_serves_reads_and_refuses_writes(
    model_path: str, cold: ColdOracle, tmp_path: Path, scorecard: Scorecard
):
    prefix = without_dac_override()
    if os.geteuid() == 0 and not prefix:
        pytest.skip("running as root without setpriv: permissions cannot make a directory read-only")
    path = tmp_path / "kv"
    files = fill(model_path, path)
    new_prompts = random_prompts(4, 100, seed=22)
    _make_read_only(path, True)
    try:
        worker = spawn("engine_worker.py", {
            "mode": "run", "model": model_path, "max_tokens": MAX_TOKENS, "rounds": [PROMPTS, new_prompts],
            "options": {**STORE_ONLY, "kv_offload": "disk", "kv_offload_disk_path": str(path)},
        }, prefix)
        result = last_json(worker)
    finally:
        _make_read_only(path, False)
    old, new = result["rounds"]
    disk = result["tiers"]["disk"]
    wrong = wrong_outputs(old["outputs"], cold(model_path, PROMPTS, MAX_TOKENS))
    wrong += wrong_outputs(new["outputs"], cold(model_path, new_prompts, MAX_TOKENS))
    scorecard.add(
        "disk", "read-only directory", requests=len(PROMPTS) + len(new_prompts), wrong_outputs=wrong, faults=1,
        lost_records=len(files) - len(record_files(path)), loaded_tokens=old["counters"]["kv_loaded_tokens"],
        write_errors=disk["errors"], writes_refused=disk["put_rejected"], health_after=disk["health"],
    )
    assert wrong == 0
    assert old["counters"]["kv_loaded_tokens"] == LOADABLE
    assert disk["puts"] == 0 and disk["errors"] >= 1 and disk["health"] == "unhealthy"
    assert record_files(path) == files and not temp_files(path)


def _make_read_only(root: Path, read_only: bool) -> None:
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        directory.chmod(0o555 if read_only else 0o755)


def test_disk_budget_smaller_than_the_working_set(
    model_path: str, cold: ColdOracle, tmp_path: Path, scorecard: Scorecard
):
    prompts = random_prompts(8, 100, seed=23)
    budget = 5 * RECORD_BYTES
    peak = {"usage": 0, "files": 0}

    with disk_engine(model_path, tmp_path, kv_offload_disk_size=f"{budget}B") as llm:
        def sample(_: int) -> None:
            peak["usage"] = max(peak["usage"], tier(llm.engine, "disk")["usage_bytes"])
            peak["files"] = max(peak["files"], bytes_on_disk(tmp_path))

        runs = [drive(llm.engine, prompts, MAX_TOKENS, on_step=sample) for _ in range(2)]
        assert store_of(llm.engine).drain(30)
        sample(0)
        disk = tier(llm.engine, "disk")
        store_counters = store_of(llm.engine).stats().counters
    want = cold(model_path, prompts, MAX_TOKENS)
    wrong = sum(wrong_outputs(r.outputs, want) for r in runs)
    scorecard.add(
        "disk", "budget smaller than the working set", requests=2 * len(prompts), wrong_outputs=wrong,
        budget_bytes=budget, working_set_bytes=len(prompts) * 3 * RECORD_BYTES,
        peak_usage_bytes=peak["usage"], peak_bytes_on_disk=peak["files"], evictions=disk["evictions"],
    )
    assert wrong == 0
    assert peak["usage"] <= budget and peak["files"] <= budget
    assert disk["evictions"] > 0 and disk["errors"] == 0, (disk, store_counters)


def test_sigkill_during_writes_then_restart(model_path: str, cold: ColdOracle, tmp_path: Path, scorecard: Scorecard):
    options = {**STORE_ONLY, "kv_offload": "disk", "kv_offload_disk_path": str(tmp_path)}
    saved: list[list[int]] = []
    caught = leftovers = 0
    for cycle in range(KILL_CYCLES):
        prompts, mid_write = kill_mid_writes(model_path, options, seed=1000 * cycle)
        saved += prompts
        caught += mid_write
        leftovers += len(temp_files(tmp_path))
    started = time.monotonic()
    with LLM(model=model_path, **options) as llm:
        restart_s = time.monotonic() - started
        missing = sum(missing_chunks(llm.engine, p) for p in saved)
        torn = invalid_disk_records(engine_codec(llm.engine), tmp_path)
        before = numeric_stats(llm.engine)
        replayed = saved[-REPLAYED:]
        run = drive(llm.engine, replayed, MAX_TOKENS)
        loaded = delta(before, numeric_stats(llm.engine))["kv_loaded_tokens"]
    wrong = wrong_outputs(run.outputs, cold(model_path, replayed, MAX_TOKENS))
    scorecard.add(
        "disk", "SIGKILL mid-writes, restart", requests=len(replayed), wrong_outputs=wrong, faults=KILL_CYCLES,
        lost_records=missing, torn_records=len(torn), recovery_s=restart_s, kills=KILL_CYCLES,
        kills_with_a_write_in_progress=caught, temp_files_left_by_kills=leftovers,
        temp_files_after_restart=len(temp_files(tmp_path)), prompts_reported_written=len(saved),
        records_on_disk=len(record_files(tmp_path)),
    )
    assert wrong == 0 and missing == 0 and torn == []
    assert caught == KILL_CYCLES and leftovers >= KILL_CYCLES
    assert not temp_files(tmp_path)
    assert loaded == len(replayed) * (100 - 1) // CHUNK * CHUNK


def kill_mid_writes(model: str, options: dict, seed: int) -> tuple[list[list[int]], bool]:
    """Run a looping writer until it has fully written a few prompts, then SIGKILL it
    while a record is being written (a temporary record file open while it is stopped).
    Returns the prompts it reported written, and whether a write was in progress."""
    worker = spawn("engine_worker.py", {"mode": "loop", "model": model, "options": options,
                                        "length": 100, "max_tokens": 2, "seed": seed})
    try:
        first = worker.stdout.readline()
        assert first, worker.stderr.read()[-3000:]
        caught = stop_during_a_write(worker)
    finally:
        worker.kill()
        worker.wait(30)
    lines = [first.strip(), *worker.stdout.read().splitlines()]
    return [json.loads(line)["saved"] for line in lines if line.endswith("}")], caught


def stop_during_a_write(worker: subprocess.Popen) -> bool:
    """Stop the worker at random instants until it is caught with a temporary record
    file open (a write in progress); leaves it stopped then. False if none was caught
    in time."""
    rng = random.Random(worker.pid)
    deadline = time.monotonic() + CATCH_WRITE_S
    while time.monotonic() < deadline:
        worker.send_signal(signal.SIGSTOP)
        wait_stopped(worker.pid)
        if writing(worker.pid):
            return True
        worker.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0, 0.001))
    return False


def writing(pid: int) -> bool:
    """Whether the process holds a temporary record file open."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(fd).endswith(".tmp"):
                return True
    return False


def wait_stopped(pid: int) -> None:
    """Until every thread of `pid` is stopped (a signal is delivered asynchronously)."""
    tasks = Path(f"/proc/{pid}/task")
    while not all(_state(task) in "tT" for task in tasks.iterdir()):
        time.sleep(0.0001)


def _state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread exited meanwhile
        return "T"
