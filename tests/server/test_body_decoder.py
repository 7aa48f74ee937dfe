"""The body decoder's thread decodes in memory it made resident at start."""

from __future__ import annotations

import asyncio
import json
import resource
import sys

import pytest

from engine.server.body_decoder import (
    MAX_RESERVE_BYTES,
    BodyDecoder,
    keep_freed_memory,
    reserve_for,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread page-fault counts are Linux's")
PAGE = resource.getpagesize()


def _faults_of(fn, *args) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    fn(*args)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _decode_faults(decoder: BodyDecoder, body: bytes) -> int:
    async def run() -> int:
        return await decoder.run(_faults_of, json.loads, body)

    try:
        return asyncio.run(run())
    finally:
        decoder.close()


def test_a_reserved_decoder_decodes_a_big_body_without_touching_fresh_pages():
    if not keep_freed_memory():
        pytest.skip("malloc is not glibc's: nothing keeps freed memory resident")
    # Text with one character beyond Latin-1, as most real text has: two bytes a character.
    body = json.dumps({"prompt": "ą" + "plain words\n" * 200_000}).encode()
    faults = _decode_faults(BodyDecoder(reserve_bytes=reserve_for(len(body))), body)
    assert faults < 0.05 * len(body) / PAGE


def test_the_reserve_grows_with_the_body_limit_up_to_one_heap():
    assert reserve_for(1024**2) == 4 * 1024**2
    assert reserve_for(1024**3) == MAX_RESERVE_BYTES
