"""Start-up of the built-in model two ways: the checkpoint directory that
`kvtier download-model` converted once, against reading its GGUF file at every start
(parse, dequantize, build the tokenizer). Each repeat builds `LLM(model=...)` both ways,
in alternating order, in fresh processes, so neither finds the other's imports or files
warm in its own memory (the page cache is shared, as it is for a real restart).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench import plots
from bench.common import markdown_table, median, parse_with_smoke
from bench.summary import publish, run_stamp
from engine.builtin_models import builtin_path, smollm2_gguf_path

NAME = "startup"
WAYS = ("converted", "gguf")
# one start in a fresh process: imports, then LLM(...) timed phase by phase
_CHILD = """
import json, sys, time
started = time.perf_counter()
from engine import LLM
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], num_kv_blocks=64, fuse_elementwise=sys.argv[3] == "fused")
built = time.perf_counter()
print(json.dumps({"import_s": imported - started, "llm_s": built - imported}))
"""


SMOKE = {"repeats": 1}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    return parse_with_smoke(p, argv, SMOKE)


def start_once(model: str, dtype: str, fused: bool = True) -> dict[str, float]:
    """One start; `fused`: with the fused elementwise chains compiled, as `kvtier serve` starts
    (--smoke: eager, which leaves out the compile, about 30 s of a smoke run)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, model, dtype, "fused" if fused else "eager"],
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    models = {"converted": builtin_path("smollm2"), "gguf": smollm2_gguf_path()}
    samples: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        for way in WAYS if repeat % 2 == 0 else reversed(WAYS):
            samples[way].append(start_once(models[way], args.dtype, fused=not args.smoke))
    result = {**run_stamp(NAME, argv), "args": vars(args), "models": models, "samples": samples,
              "summary": {way: {"llm_s": median([s["llm_s"] for s in runs]),
                                "import_s": median([s["import_s"] for s in runs])}
                          for way, runs in samples.items()}}
    plot(result)
    publish(NAME, result, render(result))
    return 0


def render(result: dict) -> str:
    summary = result["summary"]
    rows = [[way, summary[way]["llm_s"], summary[way]["import_s"], result["models"][way]] for way in WAYS]
    return (f"Start-up of `LLM()` on SmolLM2-135M-Instruct, median of {result['args']['repeats']} fresh "
            f"processes per way, --dtype {result['args']['dtype']}\n\n"
            + markdown_table(["way", "LLM(...) s", "imports s", "model"], rows))


def plot(result: dict) -> None:
    summary = result["summary"]
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("LLM(...) construction", "way", "seconds", list(WAYS),
                    {"median": [summary[w]["llm_s"] for w in WAYS]}, kind="bar"),
    ], "Start-up: converted checkpoint vs GGUF read at every start")


def describe(result: dict) -> str:
    summary = result["summary"]
    converted, gguf = summary["converted"]["llm_s"], summary["gguf"]["llm_s"]
    return (f"Building the engine on the converted checkpoint took {converted:.2f} s against {gguf:.2f} s "
            f"reading the GGUF file ({gguf / converted:.1f}x), imports ({summary['converted']['import_s']:.1f} s) "
            "apart. The GGUF way parses the file's metadata (49k tokens and merges as separate fields), "
            "dequantizes every tensor and converts the tokenizer at each start; the converted directory is "
            "memory-mapped fp32 safetensors cast to bf16 and a ready tokenizer.json. So the built-in model "
            "is converted once, at install, and a GGUF file passed as --model is read directly (no copy of "
            "a user's multi-GB file in the cache).")
