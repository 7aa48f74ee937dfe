"""Redis tier against real redis-server processes: standalone, password, cluster, outages."""

from __future__ import annotations

import time

import pytest
import redis

from kvstore.upkeep import Upkeep
from tiers import RedisTier, RedisUrlError, parse_redis_url


def test_url_forms():
    plain = parse_redis_url("redis://localhost")
    assert plain.nodes == (("localhost", 6379),) and not plain.cluster and not plain.ssl
    tls = parse_redis_url("rediss://user:p%40ss@cache.example:6380/2")
    assert tls.ssl and tls.username == "user" and tls.password == "p@ss" and tls.db == 2
    assert "p@ss" not in repr(tls) and "p@ss" not in tls.describe()
    cluster = parse_redis_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002")
    assert cluster.cluster and cluster.password == "pw"
    assert cluster.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    local = parse_redis_url("unix://:p%40ss@/run/redis/redis.sock?db=3")
    assert local.socket_path == "/run/redis/redis.sock" and local.nodes == () and local.db == 3
    assert local.password == "p@ss" and "p@ss" not in local.describe()


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost",
        "redis://",
        "redis://h:notaport",
        "redis://h:70000",
        "redis://a:1,b:2",
        "redis://h/x",
        "redis+cluster://a:1,b:2/3",
        "redis://h:1?ssl=true",
        "unix://relative/redis.sock",
        "unix:///run/redis.sock?ssl=true",
        "unix:///run/redis.sock?db=x",
    ],
)
def test_bad_urls_are_refused(url):
    with pytest.raises(RedisUrlError):
        parse_redis_url(url)


def test_bad_url_error_hides_the_password():
    with pytest.raises(RedisUrlError) as info:
        parse_redis_url("redis://:hunter2@h:99999")
    assert "hunter2" not in str(info.value)


def test_roundtrip_contains_delete_and_usage(redis_url):
    def main():
        tier = RedisTier(redis_url)
        assert tier.put([("k-1", b"one"), ("k-2", bytearray(b"two" * 1000))]) == [True, True]
        assert tier.contains(["k-1", "k-2", "k-3"]) == [True, True, False]
        assert tier.get(["k-2", "k-3", "k-1"]) == [b"two" * 1000, None, b"one"]
        assert tier.probe() and tier.usage_bytes > 0 and tier.entries == 2
        assert tier.delete(["k-1"]) == 1
        assert tier.get(["k-1"]) == [None]
        tier.close()

    main()


def test_put_keeps_what_redis_already_holds(redis_url):
    def main():
        tier = RedisTier(redis_url)
        assert tier.put([("k-1", b"first")]) == [True]
        assert tier.put([("k-1", b"second"), ("k-2", b"new")]) == [True, True]
        assert tier.get(["k-1", "k-2"]) == [b"first", b"new"]
        assert tier.counters["puts"] == 2
        tier.close()

    main()


def test_ttl_expires_records(redis_url):
    def main():
        tier = RedisTier(redis_url, ttl_s=0.2)
        tier.put([("k-1", b"x")])
        assert tier.get(["k-1"]) == [b"x"]
        time.sleep(0.35)
        assert tier.get(["k-1"]) == [None]
        tier.close()

    main()


def test_clear_only_touches_the_prefix_and_spares_pins(redis_url, redis_server):
    def main():
        tier = RedisTier(redis_url)
        tier.put([("m1-a", b"1"), ("m1-b", b"2"), ("m2-a", b"3")])
        tier.pins.pin(["m1-b"])
        assert tier.clear("m1-") == 1
        assert tier.contains(["m1-a", "m1-b", "m2-a"]) == [False, True, True]
        tier.close()

    redis_server.client().set("unrelated", b"keep")
    main()
    assert redis_server.client().get("unrelated") == b"keep"


def test_password_protected_server(redis_factory):
    server = redis_factory("--requirepass", "s3cret")

    def main():
        good = RedisTier(server.url)
        assert good.put([("k", b"v")]) == [True]
        assert good.get(["k"]) == [b"v"]
        bad = RedisTier(f"redis://:wrong@127.0.0.1:{server.port}")
        assert bad.get(["k"]) == [None]
        assert bad.health.state == "unhealthy" and bad.counters["errors"] == 1
        good.close()
        bad.close()

    main()


def test_killed_redis_gives_misses_and_recovers_by_itself(redis_factory):
    server = redis_factory()

    def main():
        tier = RedisTier(server.url, op_timeout_s=0.5, probe_interval_s=0.05)
        tier.health = type(tier.health)(min_backoff_s=0.05, max_backoff_s=0.2)
        upkeep = Upkeep()
        upkeep.every(*tier.upkeep()[0])
        assert tier.put([("k", b"v")]) == [True]
        server.kill()
        start = time.monotonic()
        assert tier.get(["k"]) == [None]
        assert tier.put([("k2", b"v")]) == [False]
        assert tier.contains(["k"]) == [False]
        assert time.monotonic() - start < 1.0
        assert tier.health.state == "unhealthy"
        server.start()  # same port, empty (no persistence)
        for _ in range(100):
            if tier.health.state == "healthy":
                break
            time.sleep(0.05)
        assert tier.health.state == "healthy"  # recovered without any traffic
        assert tier.put([("k", b"again")]) == [True]
        assert tier.get(["k"]) == [b"again"]
        upkeep.close(5)
        tier.close()

    main()


def test_paused_redis_is_bounded_by_the_timeout(redis_factory):
    server = redis_factory()

    def main():
        tier = RedisTier(server.url, op_timeout_s=0.3)
        tier.health = type(tier.health)(min_backoff_s=0.05)
        tier.put([("k", b"v")])
        server.pause()
        try:
            start = time.monotonic()
            assert tier.get(["k"]) == [None]
            assert time.monotonic() - start < 0.6
            assert tier.health.state == "unhealthy"
        finally:
            server.resume()
        time.sleep(0.1)
        assert tier.get(["k"]) == [b"v"]
        assert tier.health.state == "healthy"
        tier.close()

    main()


def test_cluster_roundtrip_across_slots(redis_cluster):
    keys = [f"k-{i:03d}" for i in range(60)]

    def main():
        tier = RedisTier(redis_cluster)
        assert tier.put([(k, k.encode() * 10) for k in keys]) == [True] * len(keys)
        assert tier.contains([*keys, "absent"]) == [True] * len(keys) + [False]
        assert tier.get(keys) == [k.encode() * 10 for k in keys]
        assert tier.probe() and tier.entries >= len(keys)
        assert tier.clear("k-") == len(keys)
        assert tier.contains(keys[:5]) == [False] * 5
        tier.close()

    main()


def test_records_are_read_straight_into_the_callers_buffers(redis_factory):
    server = redis_factory("--requirepass", "s3cret")

    def main():
        tier = RedisTier(f"redis://:s3cret@127.0.0.1:{server.port}/3")  # AUTH and SELECT
        assert tier.put([("k-1", b"x" * 5000), ("k-2", b"short")]) == [True, True]
        tier._client.rpush(tier.key_prefix + "k-3", b"a list, not a record")
        buffers = [memoryview(bytearray(6000)), memoryview(bytearray(3)), memoryview(bytearray(10)),
                   memoryview(bytearray(10))]
        got = tier.get(["k-1", "k-2", "k-3", "absent"], buffers)
        assert got[0].obj is buffers[0].obj and bytes(got[0]) == b"x" * 5000
        assert bytes(got[1]) == b"sho"  # cut to its buffer: the decoder rejects it
        assert got[2:] == [None, None] and tier.health.state == "healthy"
        server.kill()
        assert tier.get(["k-1"], buffers[:1]) == [None] and tier.health.state == "unhealthy"
        tier.close()

    main()


def test_records_over_a_unix_socket(redis_factory, tmp_path):
    """A Redis on this host through its Unix socket: records read into the caller's
    buffers (tiers.resp) and through redis-py's pipeline, AUTH and SELECT on both."""
    socket_path = tmp_path / "r.sock"
    redis_factory("--unixsocket", str(socket_path), "--requirepass", "s3cret")

    def main():
        tier = RedisTier(f"unix://:s3cret@{socket_path}?db=2")
        assert tier.put([("k-1", b"x" * 5000), ("k-2", b"y" * 10)]) == [True, True]
        assert tier.contains(["k-1", "absent"]) == [True, False]
        into = tier.get(["k-1", "absent"], [memoryview(bytearray(6000)), memoryview(bytearray(10))])
        whole = tier.get(["k-2"])
        assert tier.health.state == "healthy"
        tier.close()
        return bytes(into[0]), into[1], whole

    assert main() == (b"x" * 5000, None, [b"y" * 10])
    db2 = redis.Redis(unix_socket_path=str(socket_path), password="s3cret", db=2)
    assert db2.dbsize() > 0 and redis.Redis(unix_socket_path=str(socket_path), password="s3cret").dbsize() == 0
