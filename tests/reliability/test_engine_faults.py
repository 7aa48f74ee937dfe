"""Engine faults: a request that makes the model raise, or that gets NaN logits, fails
alone (an error finish in the engine, a 500 from the server) while the requests batched
with it finish with the cold run's output; nothing it computed reaches the prefix cache or the store; abort
storms leave no block held; a request the pool can never hold gets a clear 400."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
from reliability_support import (
    ADMIN_TOKEN,
    ENGINE,
    GARBAGE,
    NAN_TOKEN,
    POISON_AT,
    POISON_TOKEN,
    STORE_ONLY,
    ColdOracle,
    FaultServer,
    chunk_keys,
    drive,
    greedy,
    held_blocks,
    missing_chunks,
    poison,
    random_prompts,
    store_of,
    wait_until,
    wrong_outputs,
)
from scorecard import Scorecard
from sse_client import Completion, complete, kv_stats, server_held_blocks, stream, wait_idle

from engine import LLM

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 6
NORMAL_TOKENS = 160  # the normal streams outlive the culprit
STORM_CLIENTS = 48
STORM_ROUNDS = 2


def poisoned_prompt(seed: int, length: int = 80, token: int = POISON_TOKEN) -> list[int]:
    prompt = random_prompts(1, length, seed)[0]
    prompt[POISON_AT] = token
    return prompt


# (what the culprit holds, what the model leaves in its KV, scenario name, its error)
CULPRITS = {
    "wrong KV": (POISON_TOKEN, GARBAGE, "request raising in the model, leaving wrong KV", "poisoned"),
    "NaN KV": (POISON_TOKEN, float("nan"), "request raising in the model, leaving NaN KV", "poisoned"),
    "NaN logits": (NAN_TOKEN, GARBAGE, "request with NaN logits", "NaN or infinite logits"),
}


@pytest.mark.parametrize("kind", list(CULPRITS))
def test_a_failing_request_fails_alone(kind: str, model_path: str, cold: ColdOracle, scorecard: Scorecard):
    """The culprit comes first in its batch, so its blocks are freed first and reused
    first; the requests after it have different lengths, so their batched decodes read
    padding slots of those blocks."""
    token, garbage, scenario, error = CULPRITS[kind]
    prompts = [random_prompts(1, n, seed=n)[0] for n in (50, 60, 70, 80, 90)]
    culprit = poisoned_prompt(seed=32, token=token)
    follow_up = culprit[:POISON_AT] + random_prompts(1, 40, seed=33)[0]  # shares its first chunk
    with LLM(model=model_path, **{**ENGINE, "num_kv_blocks": 40}, kv_offload="cpu") as llm:
        poison(llm.engine, garbage)
        run = drive(llm.engine, [culprit, *prompts], MAX_TOKENS)
        culprit_id = run.ids[0]
        stored_culprit_chunks = len(chunk_keys(llm.engine, culprit)) - missing_chunks(llm.engine, culprit)
        after = drive(llm.engine, [follow_up, *prompts], MAX_TOKENS)
        leaked = held_blocks(llm.engine)
    want = cold(model_path, prompts, MAX_TOKENS)
    wrong = wrong_outputs(run.outputs[1:], want)
    wrong += wrong_outputs(after.outputs, cold(model_path, [follow_up], MAX_TOKENS) + want)
    scorecard.add(
        "engine", f"{scenario} (engine)",
        requests=len(run.ids) + len(after.ids), wrong_outputs=wrong, faults=1, leaked_blocks=leaked,
        culprit_finish=str(run.finish[culprit_id]),
        batch_mates_finished=sum(run.finish[i] == "length" for i in run.ids[1:]),
        culprit_chunks_stored=stored_culprit_chunks,
    )
    assert run.finish[culprit_id] == "error" and error in run.errors[culprit_id]
    assert all(run.finish[i] == "length" and run.errors[i] is None for i in run.ids[1:])
    assert wrong == 0 and leaked == 0
    if kind != "NaN logits":  # NaN logits come after the step's saves, of the culprit's real KV
        assert stored_culprit_chunks == 0


def test_aborts_during_store_loads_leak_nothing(model_path: str, cold: ColdOracle, tmp_path: Path,
                                              scorecard: Scorecard):
    prompts = random_prompts(8, 100, seed=39)
    with LLM(model=model_path, **STORE_ONLY, kv_offload="disk", kv_offload_disk_path=str(tmp_path)) as llm:
        engine, slots = llm.engine, llm.engine.connector.store.host  # host slots loads land in
        drive(engine, prompts, MAX_TOKENS)
        assert store_of(engine).drain(30)
        aborted_while_loading = 0
        for round_ in range(STORM_ROUNDS):
            ids = [f"abort-{round_}-{i}" for i in range(len(prompts))]
            for rid, prompt in zip(ids, prompts, strict=True):
                engine.add_request(rid, prompt, greedy(MAX_TOKENS))
            engine.step()  # admitted: their chunks load from disk asynchronously
            aborted_while_loading += engine.stats()["num_requests_loading_kv"]
            engine.abort_request(ids)
        settle_s = wait_until(lambda: not engine.step() and slots.slots_in_use == 0, 30)
        leaked = held_blocks(engine)
        after = drive(engine, prompts, MAX_TOKENS)
    wrong = wrong_outputs(after.outputs, cold(model_path, prompts, MAX_TOKENS))
    scorecard.add(
        "engine", "aborts during store loads (engine)", requests=(STORM_ROUNDS + 2) * len(prompts),
        wrong_outputs=wrong, faults=STORM_ROUNDS * len(prompts), leaked_blocks=leaked, recovery_s=settle_s,
        aborted_while_loading=aborted_while_loading,
        staging_buffers_free_after=f"{slots.num_slots - slots.slots_in_use}/{slots.num_slots}",
    )
    assert aborted_while_loading > 0 and leaked == 0 and wrong == 0


async def _mixed_load(
    url: str, prompts: list[list[int]], culprits: tuple[list[int], list[int]]
) -> tuple[list[Completion], Completion, Completion, int]:
    """Long normal streams; once all of them decode, two culprits (plain, streamed): their
    prefill shares a step with the decodes. Two different prompts, so that neither can
    load what the other's failed step saved (NaN logits come after the step's saves)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        decoding = [asyncio.Event() for _ in prompts]
        normal = [asyncio.ensure_future(stream(client, p, NORMAL_TOKENS, first_token=e))
                  for p, e in zip(prompts, decoding, strict=True)]
        await asyncio.gather(*(e.wait() for e in decoding))
        bad_plain, bad_stream = await asyncio.gather(
            complete(client, culprits[0], MAX_TOKENS), stream(client, culprits[1], MAX_TOKENS)
        )
        still_running = sum(not task.done() for task in normal)
        return await asyncio.gather(*normal), bad_plain, bad_stream, still_running


@pytest.mark.parametrize(("token", "scenario"), [
    (POISON_TOKEN, "request raising in the model (server)"), (NAN_TOKEN, "request with NaN logits (server)"),
])
def test_failing_request_gets_500_and_the_batch_completes(
    token: int, scenario: str, fault_server: FaultServer, model_path: str, cold: ColdOracle,
    scorecard: Scorecard,
):
    prompts = random_prompts(6, 60, seed=34)
    culprits = (poisoned_prompt(seed=35, token=token), poisoned_prompt(seed=135, token=token))
    normal, bad_plain, bad_stream, overlapping = asyncio.run(_mixed_load(fault_server.url, prompts, culprits))
    want = cold.texts(model_path, prompts, NORMAL_TOKENS)
    wrong = sum(n.text != w or n.finish_reason != "length" or n.error is not None
                for n, w in zip(normal, want, strict=True))
    idle_s = wait_idle(fault_server.url, ADMIN_TOKEN)
    scorecard.add(
        "engine", scenario, requests=len(prompts) + 2, wrong_outputs=wrong, faults=2,
        leaked_blocks=server_held_blocks(kv_stats(fault_server.url, ADMIN_TOKEN)), recovery_s=idle_s,
        culprit_status=bad_plain.status, culprit_stream_error=str((bad_stream.error or {}).get("code")),
        streams_running_when_it_failed=overlapping,
    )
    assert overlapping == len(prompts)
    assert bad_plain.status == 500 and bad_plain.error["code"] == "generation_failed"
    assert bad_stream.status == 200 and bad_stream.error["code"] == "generation_failed" and bad_stream.done
    assert wrong == 0


async def _storm(url: str, prompts: list[list[int]], seed: int) -> list[Completion]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=STORM_CLIENTS + 8)) as client:
        return await asyncio.gather(*(
            stream(client, rng.choice(prompts), 200, stop_after=rng.randint(1, 6))
            for _ in range(STORM_CLIENTS)
        ))


async def _one(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Completion:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await complete(client, prompt, max_tokens)


def test_abort_storm_leaves_no_block_held(fault_server: FaultServer, model_path: str, cold: ColdOracle,
                                          scorecard: Scorecard):
    prompts = random_prompts(8, 70, seed=36)
    drain_s, hung_up = [], 0
    for round_ in range(STORM_ROUNDS):
        results = asyncio.run(_storm(fault_server.url, prompts, seed=round_))
        hung_up += sum(not r.done for r in results)
        drain_s.append(wait_idle(fault_server.url, ADMIN_TOKEN))
    after = asyncio.run(_one(fault_server.url, prompts[0]))
    leaked = server_held_blocks(kv_stats(fault_server.url, ADMIN_TOKEN))
    wrong = int(after.text != cold.texts(model_path, prompts[:1], MAX_TOKENS)[0])
    scorecard.add(
        "engine", "abort storm", requests=STORM_ROUNDS * STORM_CLIENTS + 1, wrong_outputs=wrong,
        faults=hung_up, leaked_blocks=leaked, recovery_s=max(drain_s), clients_per_storm=STORM_CLIENTS,
        hung_up_mid_stream=hung_up,
    )
    assert hung_up == STORM_ROUNDS * STORM_CLIENTS
    assert after.status == 200 and wrong == 0
    assert leaked == 0


def test_request_larger_than_the_pool_gets_400(fault_server: FaultServer, scorecard: Scorecard):
    pool_tokens = 96 * 16
    cases = {
        "output beyond the pool": (random_prompts(1, 100, seed=37)[0], pool_tokens),
        "prompt beyond the pool": (random_prompts(1, pool_tokens + 64, seed=38)[0], 1),
    }
    answers = {name: asyncio.run(_one(fault_server.url, p, n)) for name, (p, n) in cases.items()}
    scorecard.add(
        "engine", "request larger than the device pool", requests=len(cases), wrong_outputs=0,
        faults=len(cases),
        **{f"status ({name})": a.status for name, a in answers.items()},
    )
    for answer in answers.values():
        assert answer.status == 400
        assert answer.error["code"] == "context_length_exceeded"
        assert "KV blocks" in answer.error["message"]

