"""Where the time of one engine path goes: torch.profiler op totals, grouped.

`profile_requests` runs requests on an engine under torch.profiler and returns the
top operators by self time, the same time grouped into matmul / attention / memory
movement / other ops, and the host time outside any torch op (scheduler, batch
building, sampling glue, detokenization).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

from bench.common import markdown_table
from bench.driver import greedy
from engine import LLM

MATMUL = "matmul (linear layers, QK^T, PV)"
ATTENTION = "attention kernels (flash, paged decode), softmax, masking"
COPIES = "KV and activation copies"
OTHER = "other torch ops"
HOST = "host (Python: scheduler, batch building, sampling glue)"
_EXACT = {
    "aten::mm": MATMUL, "aten::bmm": MATMUL, "aten::addmm": MATMUL, "aten::baddbmm": MATMUL,
    "mkldnn::_linear_pointwise": MATMUL,
    "aten::_softmax": ATTENTION, "aten::masked_fill_": ATTENTION, "aten::triu_": ATTENTION,
    "aten::copy_": COPIES, "aten::index_select": COPIES, "aten::index_copy_": COPIES,
    "aten::index_put_": COPIES, "aten::_index_put_impl_": COPIES, "aten::cat": COPIES,
    "aten::clone": COPIES, "kvtier_cpu::write_kv": COPIES,
}


def category(op: str) -> str:
    if "scaled_dot_product" in op or op == "kvtier_cpu::decode_attention":
        return ATTENTION
    return _EXACT.get(op, OTHER)


def profile_call(fn: Callable[[], object], top: int = 10) -> dict[str, object]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall_ms = 1000 * (time.perf_counter() - start)
    ops = [(e.key, e.self_cpu_time_total / 1000, e.count) for e in prof.key_averages()]
    ops.sort(key=lambda op: op[1], reverse=True)
    groups = dict.fromkeys((MATMUL, ATTENTION, COPIES, OTHER), 0.0)
    for key, ms, _ in ops:
        groups[category(key)] += ms
    groups[HOST] = max(wall_ms - sum(groups.values()), 0.0)
    return {
        "wall_ms": wall_ms,
        "groups_ms": groups,
        "top_ops": [{"op": key, "self_ms": ms, "calls": n} for key, ms, n in ops[:top]],
    }


def profile_requests(llm: LLM, prompts: list[list[int]], max_tokens: int, label: str) -> dict[str, object]:
    """`prompts` run together to completion on `llm`, profiled; salted so that they find
    nothing in the prefix cache."""
    result = profile_call(lambda: llm.generate(prompts, greedy(max_tokens), use_tqdm=False, cache_salt=label))
    result.update(label=label, requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                  output_tokens=max_tokens * len(prompts))
    return result


def render_profile(result: dict[str, object]) -> str:
    wall = result["wall_ms"]
    text = (f"Profile of {result['label']}: {result['requests']} request(s), {result['prompt_tokens']} prompt "
            f"tokens, {result['output_tokens']} output tokens; {wall:.0f} ms wall under torch.profiler\n\n")
    rows = [[name, ms, 100 * ms / wall] for name, ms in result["groups_ms"].items()]
    text += markdown_table(["where", "ms", "% of wall"], rows)
    ops = [[op["op"], op["self_ms"], op["calls"]] for op in result["top_ops"]]
    return text + "\n" + markdown_table(["top ops by self time", "ms", "calls"], ops)


def profile_sentence(result: dict[str, object]) -> str:
    """One sentence: the profiled path and its time per group, largest first."""
    wall = result["wall_ms"]
    groups = sorted(result["groups_ms"].items(), key=lambda item: item[1], reverse=True)
    shares = ", ".join(f"{name} {100 * ms / wall:.0f}%" for name, ms in groups)
    return (f"Where the time goes, from a torch.profiler run of {result['label']} ({result['prompt_tokens']} "
            f"prompt and {result['output_tokens']} output tokens, {wall:.0f} ms): {shares}.")


def profile_tables(result: dict) -> str:
    """A result's profile (under its "profile" key) as tables after the workload's own;
    nothing when the run had none."""
    return "\n" + render_profile(result["profile"]) if "profile" in result else ""


def profile_note(result: dict) -> str:
    """`profile_sentence` of a result's profile; nothing when the run had none."""
    return profile_sentence(result["profile"]) if "profile" in result else ""
