"""Two engine processes share chunks through a real Redis and through one disk
directory; another model, another KV dtype or another cache_salt never sees them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from offload_workloads import CHUNK, one_by_one, random_prompts

from engine import LLM

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def test_a_second_process_loads_what_the_first_saved(tiny_model_factory, redis_url, tmp_path):
    model, other_model = tiny_model_factory("llama"), tiny_model_factory("llama", seed=1)
    prompts = random_prompts([200, 130, 257], vocab_size=480, seed=21)
    common = {"dtype": "float32", "kv_chunk_tokens": CHUNK, "num_kv_blocks": 64}
    stores = {
        "redis": {**common, "kv_offload": "redis", "kv_redis_url": redis_url},
        "disk": {**common, "kv_offload": "disk", "kv_offload_disk_path": str(tmp_path / "kv")},
    }
    expected = {}
    for name, options in stores.items():
        with LLM(model=model, **options) as llm:  # closing writes out every pending save
            expected[name] = one_by_one(llm, prompts, 5)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": model, "other_model": other_model, "prompts": prompts,
                                "max_tokens": 5, "salt": "tenant-b", "stores": stores}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    done = subprocess.run([sys.executable, str(HERE / "share_worker.py"), str(spec)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    loadable = sum((n - 1) // CHUNK * CHUNK for n in (200, 130, 257))
    for name in stores:
        assert results[name]["same"]["outputs"] == expected[name]
        assert results[name]["same"]["loaded"] == loadable
        assert results[name]["salted"]["outputs"] == expected[name]
        assert results[name]["salted"]["loaded"] == 0
        assert results[name]["other_model"]["loaded"] == 0
        assert results[name]["other_dtype"]["loaded"] == 0
