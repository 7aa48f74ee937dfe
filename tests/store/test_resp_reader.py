"""The Redis tier's bulk reader (tiers/resp.py) against a real redis-server: replies land
in the caller's buffers, and an idle connection that Redis closed is never used again."""

from __future__ import annotations

from redis import Redis

from tiers.redis_url import parse_redis_url
from tiers.resp import BulkReader


def read(reader: BulkReader, keys: list[str], size: int) -> list[bytes | None]:
    buffers = [memoryview(bytearray(size)) for _ in keys]
    sizes = reader.get_into(keys, buffers)
    return [None if n is None else bytes(b[:n]) for b, n in zip(buffers, sizes, strict=True)]


def test_replies_land_in_the_buffers_and_a_missing_key_is_none(redis_url):
    reader = BulkReader(parse_redis_url(redis_url), timeout_s=5.0, connect_timeout_s=5.0)
    Redis.from_url(redis_url).mset({"a": b"x" * 100, "b": b"yz"})
    try:
        assert read(reader, ["a", "missing", "b"], 64) == [b"x" * 64, None, b"yz"]
    finally:
        reader.close()


def test_a_restarted_server_costs_no_failed_read(redis_factory):
    server = redis_factory()
    reader = BulkReader(parse_redis_url(server.url), timeout_s=5.0, connect_timeout_s=5.0)
    try:
        server.client().set("k", b"before")
        assert read(reader, ["k"], 16) == [b"before"]  # its connection is idle in the pool now
        server.kill()
        server.start()
        server.client().set("k", b"after")
        assert read(reader, ["k"], 16) == [b"after"]
    finally:
        reader.close()
