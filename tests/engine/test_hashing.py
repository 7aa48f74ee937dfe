"""Block hashes: chained, salted, incremental, and equal across separate processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.hashing import BlockHasher

REPO = Path(__file__).resolve().parents[2]
TOKENS = [0, 1, 2**31, 2**32 - 1, *range(100, 160)]
SCRIPT = """
from engine.hashing import BlockHasher
hasher = BlockHasher(b"fingerprint", 16)
print(",".join(h.hex() for h in hasher.hashes({tokens!r}, "tenant")))
"""


def test_hashes_equal_across_processes_with_different_hash_seeds():
    expected = ",".join(h.hex() for h in BlockHasher(b"fingerprint", 16).hashes(TOKENS, "tenant"))
    for hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(tokens=TOKENS)],
            env=env, capture_output=True, text=True, check=True, cwd=REPO,
        )
        assert result.stdout.strip() == expected


def test_only_full_blocks_are_hashed_and_extension_is_incremental():
    hasher = BlockHasher(b"fp", 4)
    tokens = list(range(11))
    full = hasher.hashes(tokens)
    assert len(full) == 2
    grown: list[bytes] = []
    for end in range(len(tokens) + 1):
        hasher.extend(grown, tokens[:end], None)
    assert grown == full


def test_hash_is_chained_on_the_whole_prefix():
    hasher = BlockHasher(b"fp", 4)
    base = hasher.hashes(list(range(8)))
    changed = hasher.hashes([99, 1, 2, 3, 4, 5, 6, 7])
    assert base[0] != changed[0] and base[1] != changed[1]


def test_salt_fingerprint_and_block_size_change_every_hash():
    tokens = list(range(8))
    base = BlockHasher(b"fp", 4).hashes(tokens)
    for other in (
        BlockHasher(b"fp", 4).hashes(tokens, "salt"),
        BlockHasher(b"other-model", 4).hashes(tokens),
    ):
        assert not set(base) & set(other)
    assert BlockHasher(b"fp", 8).hashes(tokens)[0] not in base
    assert BlockHasher(b"fp", 4).hashes(tokens, "") == base
