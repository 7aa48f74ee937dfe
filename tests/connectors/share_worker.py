"""The second process of test_cross_process.py: serves prompts from stores another
process filled (Redis, a disk directory) and prints outputs and loaded tokens as JSON.

    python share_worker.py SPEC.json    (keys: model, other_model, prompts, max_tokens,
                                         salt, stores: {name: engine options})
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from offload_workloads import counters, delta, generate

from engine import LLM


def serve(model: str, options: dict, prompts: list[list[int]], max_tokens: int, salt: str | None) -> dict:
    with LLM(model=model, **options) as llm:
        before = counters(llm)
        outputs = [generate(llm, [p], [max_tokens], cache_salt=salt)[0] for p in prompts]
        return {"outputs": outputs, "loaded": delta(before, counters(llm))["kv_loaded_tokens"]}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    results = {}
    for name, options in spec["stores"].items():
        results[name] = {
            "same": serve(spec["model"], options, prompts, max_tokens, None),
            "salted": serve(spec["model"], options, prompts, max_tokens, spec["salt"]),
            "other_model": serve(spec["other_model"], options, prompts, max_tokens, None),
            "other_dtype": serve(spec["model"], {**options, "dtype": "bfloat16"}, prompts, max_tokens, None),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
