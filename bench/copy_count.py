"""Copies of a record's bytes per chunk, counted on the running code: how many times the
engine, the connector and the store copy a chunk's KV in user space on a save, a cpu hit,
and a disk or Redis hit (into a cpu tier, from a second instance).

A line tracer counts the executed lines of kvstore/, tiers/, connectors/ and kvkernels/
that copy a buffer (`copy_`, `index_select`, `index_copy_`, block
gathers and scatters, a memoryview slice assignment, `bytes(...)`, `tobytes`); the
kernel's copy of a file read or a socket receive into a caller's buffer (`readinto`,
`recv_into`) is not one. A line's bytes are those of the smallest buffer of 4 KiB or
more that it names (the destination or the source, not the cache or slab it indexes
into). The counts (bytes copied over bytes of records) are per chunk saved or loaded (the engine's
kv_saved_chunks and kv_loaded_tokens) and list the lines that copied, so a reader can
check each one. It imports only `engine` and `bench.text_corpus`, so the same file measures another
checkout:
`PYTHONPATH=/path/to/checkout python bench/copy_count.py`.
"""

from __future__ import annotations

import collections
import linecache
import re
import sys
import tempfile
import threading
from pathlib import Path

import torch

from bench.text_corpus import documents
from engine import LLM, SamplingParams

CHUNK_TOKENS = 64
CHUNKS = 4  # full chunks per prompt
PACKAGES = ("kvstore", "tiers", "connectors", "kvkernels")
COPY = re.compile(r"\.copy_\(|index_select|index_copy_|\[[^\]]*:[^\]]*\]\s*=[^=]|(?<![\w.])bytes\(|tobytes\(")
# a block hash, a list splice, the few bytes a RESP reply line brought along: not a record's bytes
SMALL = re.compile(r"HASH_SIZE|\[:0\] =|self\._pending")


def nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    return 0


def copy_size(code: str, names: dict) -> int:
    """The bytes a copying line moves: the smallest buffer of at least 4 KiB that it names
    (the destination or source; a whole cache or slab it indexes into is larger)."""
    sizes = [nbytes(names[n]) for n in re.findall(r"[A-Za-z_]\w*", code) if n in names]
    sizes = [size for size in sizes if size >= 4096]
    return min(sizes, default=0)


class CopyTracer:
    """Sums the bytes of the copying lines executed in the store's packages, every thread."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = tuple(str(r) for r in roots)
        self.lines: collections.Counter[tuple[str, int]] = collections.Counter()
        self.active = False

    def _local(self, frame, event, arg):
        if event == "line" and self.active:
            path, line = frame.f_code.co_filename, frame.f_lineno
            code = linecache.getline(path, line).split("#")[0]
            if COPY.search(code) and not SMALL.search(code):
                self.lines[(path, line)] += copy_size(code, frame.f_locals)
        return self._local

    def _global(self, frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(self.roots):
            return None
        if "/kvkernels/" in path and "_blocks" not in frame.f_code.co_name:
            return None  # attention and KV writes read the cache; only block gathers/scatters move records
        return self._local

    def install(self) -> None:
        sys.settrace(self._global)
        threading.settrace(self._global)

    def take(self) -> collections.Counter[tuple[str, int]]:
        lines, self.lines = self.lines, collections.Counter()
        return lines


def prompt(llm: LLM, seed: int, tokens: int) -> list[int]:
    """`tokens` tokens of real text (a passage of the corpus that `seed` picks)."""
    ids = llm.engine.tokenizer.encode(documents(1, 12 * tokens, seed=seed)[0], add_special_tokens=False)
    return ids[:tokens]


def serve(llm: LLM, tokens: list[int]) -> None:
    llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)


def drain(llm: LLM) -> None:
    store = getattr(llm.engine.connector, "store", None)
    if store is not None and hasattr(store, "drain"):
        store.drain(30)


def traced(tracer: CopyTracer, llm: LLM, tokens: list[int], counter: str) -> tuple[collections.Counter, float]:
    """The copying lines of serving `tokens` (and writing its saves behind), and how many
    chunks that moved by the engine's `counter` (saved chunks, or loaded tokens)."""
    before = llm.engine.stats().get(counter, 0)
    tracer.active = True
    serve(llm, tokens)
    drain(llm)
    tracer.active = False
    moved = llm.engine.stats().get(counter, 0) - before
    chunks = moved / (CHUNK_TOKENS if counter == "kv_loaded_tokens" else 1)
    return tracer.take(), chunks * llm.engine.block_bytes * CHUNK_TOKENS // llm.engine.config.block_size


def measure(tracer: CopyTracer, tiers: str, workdir: Path, redis_url: str | None) -> dict[str, tuple]:
    options = {"model": "builtin:tiny", "dtype": "float32", "num_kv_blocks": CHUNKS * CHUNK_TOKENS // 16 + 8,
               "kv_chunk_tokens": CHUNK_TOKENS, "kv_offload": tiers, "max_num_seqs": 1,
               "kv_offload_disk_path": str(workdir / tiers.replace(",", "-")), "kv_redis_url": redis_url}
    out = {}
    with LLM(**options) as llm:
        doc = prompt(llm, 1, CHUNKS * CHUNK_TOKENS + 1)  # CHUNKS full chunks and one more token
        out["save"] = traced(tracer, llm, doc, "kv_saved_chunks")
        if tiers == "cpu":
            for seed in (2, 3):  # evict doc from the device pool
                serve(llm, prompt(llm, seed, CHUNKS * CHUNK_TOKENS + 1))
            drain(llm)
            tracer.take()
            out["cpu hit"] = traced(tracer, llm, doc, "kv_loaded_tokens")
    if tiers != "cpu":
        with LLM(**options) as second:  # a second instance: its cpu tier is empty
            out[f"{tiers.split(',')[1]} hit (promoted into cpu)"] = traced(tracer, second, doc, "kv_loaded_tokens")
    return out


def main() -> int:
    import engine

    root = Path(engine.__file__).resolve().parent.parent
    tracer = CopyTracer([root / p for p in PACKAGES])
    redis_url = sys.argv[1] if len(sys.argv) > 1 else None
    if redis_url:
        import redis

        redis.Redis.from_url(redis_url).flushdb()
    tracer.install()
    with tempfile.TemporaryDirectory() as tmp:
        configs = ["cpu", "cpu,disk"] + (["cpu,redis"] if redis_url else [])
        for tiers in configs:
            for case, (lines, moved) in measure(tracer, tiers, Path(tmp), redis_url).items():
                copies = sum(lines.values()) / max(moved, 1)
                print(f"{tiers:10} {case:30} {copies:.2f} copies per chunk ({moved / 2**20:.2f} MiB of records)")
                for (path, line), n in sorted(lines.items()):
                    where = f"{Path(path).relative_to(root)}:{line}"
                    print(f"    {n / max(moved, 1):5.2f}  {where:34} {linecache.getline(path, line).strip()[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
