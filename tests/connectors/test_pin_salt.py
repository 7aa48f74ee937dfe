"""`kv_pin` with a cache_salt pins that tenant's chunks, and only those (issue 44, item
18): a pin names chunks by the same salted block hashes that the tenant's requests save
them under. A small cpu tier and device pool, then traffic that evicts everything not
pinned; what comes back from the tier afterwards shows which chunks the pin kept."""

from __future__ import annotations

from offload_workloads import CHUNK, counters, delta, generate, random_prompts

from engine import LLM

PROMPT_TOKENS = 3 * CHUNK + 4
SALT = "tenant-a"


def test_a_salted_pin_keeps_that_tenants_chunks_and_no_others(tiny_llama):
    target, *traffic = random_prompts([PROMPT_TOKENS] * 12, vocab_size=480, seed=18)
    with LLM(model=tiny_llama, dtype="float32", fuse_elementwise=False, kv_offload="cpu",
             kv_offload_cpu_size="256KiB", kv_chunk_tokens=CHUNK, num_kv_blocks=24) as llm:
        assert llm.engine.kv_pin(target, cache_salt=SALT)["pinned_chunks"] == 3
        generate(llm, [target], [2], cache_salt=SALT)
        generate(llm, [target], [2])  # the same tokens unsalted: other chunks, not pinned
        for prompt in traffic:
            generate(llm, [prompt], [2])
        loaded = {}
        for salt in (SALT, None):
            before = counters(llm)
            generate(llm, [target], [2], cache_salt=salt)
            loaded[salt] = delta(before, counters(llm))["kv_external_hit_tokens_cpu"]
    assert loaded == {SALT: 3 * CHUNK, None: 0}
