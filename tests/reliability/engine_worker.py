"""An engine in its own process, for the scenarios that need one (another user, SIGKILL,
several engines on one store).

    python engine_worker.py '{"mode": "run", "model": ..., "options": {...},
                              "rounds": [[prompt, ...], ...], "max_tokens": n}'
        serves each round as one batch, drains the store; prints {"rounds": [{"outputs",
        "counters"}], "tiers": {tier: counters}} as the last line.
    python engine_worker.py '{"mode": "loop", "model": ..., "options": {...},
                              "length": n, "max_tokens": n, "seed": s}'
        serves new random prompts one by one until killed; after each one the store is
        drained and {"saved": prompt} printed: its chunks are then fully written.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

from reliability_support import delta, drive, numeric_stats, random_prompts, store_of

from engine import LLM

LATENCY_KEYS = ("load_latency", "save_latency")


def tier_counters(llm: LLM) -> dict[str, dict[str, Any]]:
    tiers = llm.engine.kv_store_stats()
    return {name: {k: v for k, v in s.items() if k not in LATENCY_KEYS} for name, s in tiers.items()}


def run(spec: dict) -> dict:
    rounds = []
    with LLM(model=spec["model"], **spec["options"]) as llm:
        for prompts in spec["rounds"]:
            before = numeric_stats(llm.engine)
            result = drive(llm.engine, prompts, spec["max_tokens"], deadline_s=240)
            rounds.append({"outputs": result.outputs, "counters": delta(before, numeric_stats(llm.engine))})
        store_of(llm.engine).drain(30)  # tier counters after the write-behind has tried every save
        tiers = tier_counters(llm)
    return {"rounds": rounds, "tiers": tiers}


def loop(spec: dict) -> None:
    llm = LLM(model=spec["model"], **spec["options"])
    for seed in itertools.count(spec["seed"]):
        prompt = random_prompts(1, spec["length"], seed)[0]
        drive(llm.engine, [prompt], spec["max_tokens"])
        if store_of(llm.engine).drain(30):
            print(json.dumps({"saved": prompt}), flush=True)


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    if job["mode"] == "run":
        print(json.dumps(run(job)), flush=True)
    else:
        loop(job)
