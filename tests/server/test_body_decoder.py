"""The body decoder's thread decodes in memory it made resident at start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from engine.server.body_decoder import MAX_RESERVE_BYTES, keep_freed_memory, reserve_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread page-fault counts are Linux's")

# Runs in a process of its own, as a server's decoder does: a process that has already run
# hundreds of tests hands the decoder's new thread the malloc arena of a thread that exited,
# with that thread's live blocks in it, where the reserve may land in a heap of its own that
# glibc unmaps when the reserve is freed.
_MEASURE_DECODE = textwrap.dedent(
    """
    import asyncio, json, resource, sys
    from engine.server.body_decoder import BodyDecoder, keep_freed_memory, reserve_for

    def faults_of(fn, *args):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        fn(*args)
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    body = sys.stdin.buffer.read()
    assert keep_freed_memory()
    decoder = BodyDecoder(reserve_bytes=reserve_for(len(body)))
    try:
        faults = asyncio.run(decoder.run(faults_of, json.loads, body))
    finally:
        decoder.close()
    print(faults, resource.getpagesize())
    """
)


def _decode_faults_in_a_new_process(body: bytes) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE_DECODE], input=body, capture_output=True, check=True, timeout=120
    )
    faults, page = done.stdout.split()
    return int(faults), int(page)


def test_a_reserved_decoder_decodes_a_big_body_without_touching_fresh_pages():
    if not keep_freed_memory():
        pytest.skip("malloc is not glibc's: nothing keeps freed memory resident")
    # Text with one character beyond Latin-1, as most real text has: two bytes a character.
    body = json.dumps({"prompt": "ą" + "plain words\n" * 200_000}).encode()
    faults, page = _decode_faults_in_a_new_process(body)
    assert faults < 0.05 * len(body) / page


def test_the_reserve_grows_with_the_body_limit_up_to_one_heap():
    assert reserve_for(1024**2) == 4 * 1024**2
    assert reserve_for(1024**3) == MAX_RESERVE_BYTES
