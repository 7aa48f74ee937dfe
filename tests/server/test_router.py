"""`kvtier router` over two real `kvtier serve` instances of builtin:tiny (fp32, greedy):
what comes through the router equals what one instance answers, under every policy; the
kv policy sends a prompt that repeats a prefix to the instance whose device holds it,
known from that instance's KV events; an instance that dies leaves the pool and the
requests it would have had are served by the other; prefilled on one instance and
decoded on another through a shared Redis, the outputs are the same."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.server_helpers import ServerProcess, scrape, server_flags, value

EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:*", "replay_endpoint": "tcp://*:*"})
ROUTER = (sys.executable, "-m", "engine.cli", "router")
WAIT_S = 60.0  # a deadline for conditions that come true by themselves, never a measured time


def instance() -> ServerProcess:
    return ServerProcess(*server_flags("builtin:tiny", "--kv-offload", "cpu", "--kv-offload-cpu-size", "16MiB",
                                       "--kv-chunk-tokens", "32", "--kv-events-config", EVENTS))


def router(policy: str, *workers: ServerProcess) -> ServerProcess:
    return ServerProcess("--worker-urls", *(w.url for w in workers), "--policy", policy,
                         "--health-check-interval", "0.5", command=ROUTER)


@pytest.fixture(scope="module")
def instances() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    first, second = instance(), instance()
    yield first, second
    first.stop()
    second.stop()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_S:.0f} s"
        time.sleep(0.1)


def words(seed: int, count: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 997}" for i in range(count))


REQUESTS = [
    ("/v1/completions", {"model": "tiny", "prompt": words(1, 40), "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"model": "tiny", "prompt": [words(2, 30), words(3, 20)], "max_tokens": 6,
                         "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "system", "content": words(4, 30)},
                                                            {"role": "user", "content": "hello"}],
                              "max_tokens": 10, "temperature": 0}),
]


def answers(client: httpx.Client) -> list:
    out = []
    for path, body in REQUESTS:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        out.append([c.get("text", c.get("message", {}).get("content")) for c in response.json()["choices"]])
        with client.stream("POST", path, json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            pieces = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert pieces[-1] == "data: [DONE]"
        chunks = [json.loads(p[6:]) for p in pieces[:-1]]
        streamed: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
                streamed[choice["index"]] = streamed.get(choice["index"], "") + piece
        out.append([streamed[i] for i in sorted(streamed)])
    return out


@pytest.mark.parametrize("policy", ["kv", "round-robin", "least-load", "session"])
def test_outputs_through_the_router_equal_one_instances(instances, policy):
    first, _ = instances
    with httpx.Client(base_url=first.url, timeout=120) as direct:
        expected = answers(direct)
    front = router(policy, *instances)
    try:
        with httpx.Client(base_url=front.url, timeout=120) as client:
            assert answers(client) == expected
            families = scrape(client)
            routed = sum(value(families, "kvtier:router_decisions", "kvtier:router_decisions_total",
                               policy=policy, instance=w.url) for w in instances)
            assert routed == 2 * len(REQUESTS)
    finally:
        front.stop()


def test_the_kv_policy_sends_a_repeated_prefix_where_it_is_held(instances):
    front = router("kv", *instances)
    documents = [words(10 + i, 50) for i in range(4)]  # about 200 tokens each
    try:
        with httpx.Client(base_url=front.url, timeout=120) as client:
            chosen = {}
            for i, document in enumerate(documents):
                before = decisions(client, instances)
                known = {w.url: indexed(client, w.url) for w in instances}
                assert client.post("/v1/completions", json=completion(document + " Q0")).status_code == 200
                url = chosen[i] = changed(before, decisions(client, instances))
                # its 12 full blocks at least, from the instance's events
                wait_until(lambda url=url, floor=known[url] + 12: indexed(client, url) >= floor, "indexed")
            assert len(set(chosen.values())) == 2  # the documents are spread over both
            for bad in (b"{", json.dumps({**completion("x"), "max_tokens": -1}).encode()):
                refused = client.post("/v1/completions", content=bad, headers={"Content-Type": "application/json"})
                assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
            for round_ in range(1, 3):
                for i, document in enumerate(documents):
                    before = decisions(client, instances)
                    predicted_before = predicted_device(client, chosen[i])
                    assert client.post("/v1/completions", json=completion(f"{document} Q{round_}")).status_code == 200
                    assert changed(before, decisions(client, instances)) == chosen[i]
                    assert predicted_device(client, chosen[i]) - predicted_before >= 16 * 8
    finally:
        front.stop()


def test_the_session_policy_keeps_a_user_on_one_instance(instances):
    front = router("session", *instances)
    try:
        with httpx.Client(base_url=front.url, timeout=120) as client:
            for user in ("alice", "bob", "carol", "dave"):
                before = decisions(client, instances, "session")
                for turn in range(3):
                    body = {**completion(words(50 + turn, 10)), "user": user}
                    assert client.post("/v1/completions", json=body).status_code == 200
                after = decisions(client, instances, "session")
                moved = {url for url in after if after[url] != before.get(url, 0)}
                assert len(moved) == 1, (user, before, after)
    finally:
        front.stop()


def test_an_instance_that_dies_leaves_the_pool(instances):
    first, _ = instances
    doomed = instance()
    front = router("round-robin", first, doomed)
    try:
        with httpx.Client(base_url=front.url, timeout=120) as client:
            for i in range(2):
                assert client.post("/v1/completions", json=completion(words(30 + i, 20))).status_code == 200
            doomed.process.kill()
            doomed.process.wait()
            for i in range(4):  # each one the dead instance would have had is sent to the other
                assert client.post("/v1/completions", json=completion(words(40 + i, 20))).status_code == 200
            wait_until(lambda: healthy(client, doomed.url) == 0, "out of the pool")
            assert client.get("/health").json()["instances"] == {first.url: "healthy", doomed.url: "unhealthy"}
    finally:
        front.stop()
        doomed.stop()


def test_disaggregated_outputs_equal_one_instances(instances, redis_url):
    """Each prompt prefilled on one instance (a producer), answered by another (a consumer)
    that loads its KV from the shared Redis: the same tokens as one instance computing
    everything."""
    first, _ = instances
    with httpx.Client(base_url=first.url, timeout=120) as direct:
        expected = answers(direct)
        handover = {**completion("x"), "kv_transfer_params": {"do_remote_decode": True}}
        refused = direct.post("/v1/completions", json=handover)  # its only tier is cpu
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
    shared = ("--kv-offload", "cpu,redis", "--kv-offload-cpu-size", "16MiB", "--kv-chunk-tokens", "32",
              "--kv-redis-url", redis_url)
    prefill = ServerProcess(*server_flags("builtin:tiny", *shared, "--kv-role", "producer"))
    decode = ServerProcess(*server_flags("builtin:tiny", *shared, "--kv-role", "consumer"))
    front = ServerProcess("--prefill-urls", prefill.url, "--decode-urls", decode.url, command=ROUTER)
    try:
        with httpx.Client(base_url=front.url, timeout=120) as client:
            assert answers(client) == expected
        with httpx.Client(base_url=decode.url, timeout=60) as client:
            assert value(scrape(client), "kvtier:external_hit_tokens", tier="redis") >= 16 * 8
        with httpx.Client(base_url=prefill.url, timeout=60) as client:
            assert value(scrape(client), "kvtier:external_hit_tokens", tier="redis") == 0
    finally:
        for process in (front, prefill, decode):
            process.stop()


def test_a_router_refuses_an_instance_whose_role_cannot_play_its_part():
    """A consumer never saves, so it cannot prefill for another; a producer never loads,
    so it cannot decode what another prefilled: the router names the flag and the URL."""
    import subprocess

    consumer = ServerProcess(*server_flags("builtin:tiny", "--kv-offload", "cpu", "--kv-offload-cpu-size", "16MiB",
                                           "--kv-role", "consumer"))
    try:
        with httpx.Client(base_url=consumer.url, timeout=60) as client:
            assert client.get("/instance").json()["kv_role"] == "consumer"
        done = subprocess.run([*ROUTER, "--prefill-urls", consumer.url, "--decode-urls", consumer.url],
                              capture_output=True, text=True, timeout=120)
    finally:
        consumer.stop()
    assert done.returncode == 2, done.stderr
    assert f"--prefill-urls: {consumer.url} is --kv-role consumer" in done.stderr, done.stderr


def test_router_flags_are_checked():
    for flags, message in ((["--policy", "kv"], "--worker-urls: give the URL"),
                           (["--worker-urls", "localhost:1"], "--worker-urls: 'localhost:1' is not"),
                           (["--worker-urls", "http://a:1", "--policy", "random"], "--policy")):
        import subprocess

        done = subprocess.run([*ROUTER, *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def completion(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}


def decisions(client: httpx.Client, instances, policy: str = "kv") -> dict[str, float]:
    families = scrape(client)
    return {w.url: value(families, "kvtier:router_decisions", "kvtier:router_decisions_total",
                         policy=policy, instance=w.url) for w in instances}


def changed(before: dict[str, float], after: dict[str, float]) -> str:
    moved = [url for url in after if after[url] != before.get(url, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


def indexed(client: httpx.Client, url: str) -> float:
    return value(scrape(client), "kvtier:router_instance_indexed_blocks", instance=url)


def healthy(client: httpx.Client, url: str) -> float:
    return value(scrape(client), "kvtier:router_instance_healthy", instance=url)


def predicted_device(client: httpx.Client, url: str) -> float:
    return value(scrape(client), "kvtier:router_predicted_cached_tokens",
                 "kvtier:router_predicted_cached_tokens_total", instance=url, where="device")
