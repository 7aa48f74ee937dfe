"""The control path of one store hit, traced on the running code: from the scheduler's
admission of a request whose prefix is in a lower tier (disk or Redis) to the bytes in
the device KV cache.

A first process saves a document through an engine on a disk directory or a Redis; a
second process, with an empty cpu tier, serves the same document once, under
`sys.setprofile` on every thread (installed before any thread of the store starts). The
trace opens at the engine's first call into the connector and closes when the worker's
`load` returns (every block of the load is in the KV cache then).

What it reports, for the product packages (engine, connectors, kvstore, tiers,
kvkernels) and for the store path alone (connectors, kvstore, tiers):
- modules and functions that ran, calls from one module into another, threads that ran
  them;
- hops: the distinct module -> module calls on the store path (a call from the engine
  into the connector counts), plus one per thread other than the engine's that ran store
  code (a hand-off): a hop is one boundary a reader crosses to follow a hit from admission
  to the bytes; and, finer, the distinct caller-function -> callee-function calls that
  cross a module boundary there. Calls made by asyncio's loop (a task's steps) have no
  product caller and are not seen as crossings.

It imports only `engine` and `bench`, so the same file measures another checkout:
`PYTHONPATH=/path/to/checkout python bench/hop_trace.py [disk|redis]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench.text_corpus import documents
from engine import LLM, SamplingParams

PACKAGES = ("engine", "connectors", "kvstore", "tiers", "kvkernels")
STORE_PACKAGES = ("connectors", "kvstore", "tiers")
CHUNK_TOKENS = 64
CHUNKS = 4


def engine_options(tiers: str, disk: str, redis_url: str | None) -> dict:
    return {"model": "builtin:tiny", "dtype": "float32", "num_kv_blocks": CHUNKS * CHUNK_TOKENS // 16 + 8,
            "kv_chunk_tokens": CHUNK_TOKENS, "kv_offload": tiers, "max_num_seqs": 1,
            "kv_offload_disk_path": disk, "kv_redis_url": redis_url}


def document(llm: LLM) -> list[int]:
    tokens = CHUNKS * CHUNK_TOKENS + 1
    ids = llm.engine.tokenizer.encode(documents(1, 12 * tokens, seed=1)[0], add_special_tokens=False)
    return ids[:tokens]


def serve(llm: LLM, tokens: list[int], tracer: CallTracer | None = None) -> dict:
    before = llm.engine.stats()
    if tracer is not None:  # the main thread's profile is set only now: it is costly
        tracer.state = "waiting"
        sys.setprofile(tracer)
    llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    if tracer is not None:
        sys.setprofile(None)
        tracer.state = "closed"
    after = llm.engine.stats()
    return {k: after[k] - before.get(k, 0) for k in after if k.startswith("kv_loaded_tokens")}


class CallTracer:
    """Profile events of the product's Python functions, every thread, between `open`
    and the return of connectors/worker.py's `load`."""

    def __init__(self, root: Path) -> None:
        self.root = str(root) + os.sep
        self.state = "idle"  # then "waiting", "open", "closed"
        self.engine_thread = threading.get_ident()
        self.functions: set[tuple[str, str]] = set()
        self.threads: set[int] = set()
        self.store_threads: set[int] = set()
        self.cross_calls = 0
        self.store_cross_calls = 0
        self.edges: set[tuple[str, str, str, str]] = set()

    def module(self, filename: str) -> str | None:
        if not filename.startswith(self.root):
            return None
        relative = filename[len(self.root) :]
        if not relative.startswith(PACKAGES):
            return None
        return relative[:-3].replace(os.sep, ".")

    def __call__(self, frame, event, arg) -> None:
        if self.state in ("idle", "closed") or event not in ("call", "return"):
            return
        callee = self.module(frame.f_code.co_filename)
        if callee is None:
            return
        if self.state == "waiting":
            if not (event == "call" and callee.startswith("connectors") and threading.get_ident() == self.engine_thread):
                return
            self.state = "open"
        if event == "return":
            if callee == "connectors.worker" and frame.f_code.co_name == "load":
                self.state = "closed"
            return
        name = f"{callee}.{frame.f_code.co_qualname}"
        self.functions.add((callee, name))
        thread = threading.get_ident()
        self.threads.add(thread)
        on_store = callee.startswith(STORE_PACKAGES)
        if on_store and thread != self.engine_thread:
            self.store_threads.add(thread)
        back = frame.f_back
        caller = self.module(back.f_code.co_filename) if back is not None else None
        if caller is None or caller == callee:
            return
        self.cross_calls += 1
        if on_store or caller.startswith(STORE_PACKAGES):
            self.store_cross_calls += 1
            self.edges.add((caller, back.f_code.co_qualname, callee, frame.f_code.co_qualname))

    def report(self) -> dict:
        modules = {m for m, _ in self.functions}
        store_modules = {m for m in modules if m.startswith(STORE_PACKAGES)}
        return {
            "closed": self.state == "closed",
            "modules": len(modules),
            "functions": len(self.functions),
            "cross_module_calls": self.cross_calls,
            "threads": len(self.threads),
            "store_modules": len(store_modules),
            "store_functions": sum(1 for m, _ in self.functions if m in store_modules),
            "store_cross_module_calls": self.store_cross_calls,
            "store_threads": len(self.store_threads),
            "hops": len({(a, b) for a, _, b, _ in self.edges}) + len(self.store_threads),
            "edges": sorted(f"{a}.{f} -> {b}.{g}" for a, f, b, g in self.edges),
        }


def save_phase(tiers: str, disk: str, redis_url: str | None) -> None:
    with LLM(**engine_options(tiers, disk, redis_url)) as llm:
        serve(llm, document(llm))
        llm.engine.connector.store.drain(30)


def hit_phase(tiers: str, disk: str, redis_url: str | None) -> dict:
    import engine

    tracer = CallTracer(Path(engine.__file__).resolve().parent.parent)
    threading.setprofile(tracer)  # before the store starts any thread
    with LLM(**engine_options(tiers, disk, redis_url)) as llm:
        loaded = serve(llm, document(llm), tracer)
    threading.setprofile(None)
    return {**tracer.report(), "loaded": loaded}


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] in ("--save", "--hit"):
        phase, tiers, disk, redis_url = args[0], args[1], args[2], (args[3] if len(args) > 3 else None)
        if phase == "--save":
            save_phase(tiers, disk, redis_url)
        else:
            print(json.dumps(hit_phase(tiers, disk, redis_url)))
        return 0
    cases = args or ["disk", "redis"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        for case in cases:
            redis_url = None
            if case == "redis":
                from bench.redis_server import RedisServer, find_redis_server

                server = RedisServer(find_redis_server(), Path(tmp) / "redis").start()
                redis_url = server.url
            tiers = f"cpu,{case}"
            disk = str(Path(tmp) / case)
            tail = [redis_url] if redis_url else []
            here = [sys.executable, __file__]
            subprocess.run([*here, "--save", tiers, disk, *tail], check=True)
            out = subprocess.run([*here, "--hit", tiers, disk, *tail], check=True, capture_output=True, text=True)
            results[case] = json.loads(out.stdout.strip().splitlines()[-1])
            if server is not None:
                server.kill()
    for case, result in results.items():
        print(f"{case} hit: loaded {result['loaded']}, trace closed: {result['closed']}")
        print(f"  product: {result['modules']} modules, {result['functions']} functions, "
              f"{result['cross_module_calls']} cross-module calls, {result['threads']} threads")
        print(f"  store path: {result['store_modules']} modules, {result['store_functions']} functions, "
              f"{result['store_cross_module_calls']} cross-module calls, {result['store_threads']} store threads")
        print(f"  hops: {result['hops']} (module -> module calls + {result['store_threads']} store threads); "
              f"{len(result['edges'])} distinct function -> function calls across modules:")
        for edge in result["edges"]:
            print(f"    {edge}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
