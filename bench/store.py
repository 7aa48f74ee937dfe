"""KV store throughput per tier against physical references, and lz4 on KV payloads.

Each tier's put and get throughput is measured for chunks of the built-in model
(SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64, bf16, 256-token chunks =
5.6 MiB) in batches of 16 chunks (one 4,096-token request), against a reference measured
in the same run on the same bytes:

- cpu:   torch memcpy of the same chunks (copy_ into preallocated tensors);
- disk:  one sequential file written then fsync'd, read back with the page cache dropped
         (posix_fadvise DONTNEED after fsync; the store's files get the same treatment);
- redis: raw-socket RESP SET/GET of the same bytes to the same redis-server, pipelined in
         the same batches, read with recv_into into preallocated buffers.

The store's put is the engine's save path (bench/store_io.py: a host slot reserved, the
chunk copied into it, committed to the write-behind); its get is the engine's load path:
the records of a batch are located in the manager's index and read into host slots,
verified in place (for cpu, also copied out of the slots, as the engine copies them to
the device). The best of --repeats runs is kept for every
figure, and the median of the per-run store / reference ratios (targets: get at least
80%, put at least 50%). Compression: lz4 on the whole payload
vs lz4 on the sign/exponent byte plane only, on (1) real KV of the built-in
model on real text, (2) Gaussian values, (3) a smooth synthetic payload.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from redis.utils import HIREDIS_AVAILABLE

from bench import plots
from bench.common import markdown_table, parse_with_smoke
from bench.kv_common import local_redis
from bench.store_io import save_tensors
from bench.summary import publish, run_stamp
from kvstore import ChunkSpec, StoreConfig, TieredStore, host_copy
from kvstore.compression import Codec, decompress_into, encode_segments
from kvstore.spec import tensor_bytes

NAME = "store"
TIERS = ("cpu", "disk", "redis")
TARGET = 0.8  # store get GB/s / reference GB/s, median of paired runs
PUT_TARGET = 0.5
MiB = 1024**2
Measure = tuple[Callable[[], None], Callable[[], None]]  # (timed run, untimed setup)
Figures = tuple[float, float, float]  # best reference GB/s, best store GB/s, median ratio


def NOTHING() -> None:
    return None


SMOKE = {"chunks": 4, "batch": 2, "repeats": 1, "layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 4,
         "chunk_tokens": 8, "skip_model_kv": True}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"kvtier bench {NAME}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chunks", type=int, default=64, help="Chunks per measurement (default 64).")
    p.add_argument("--batch", type=int, default=16, help="Chunks per store call / pipeline.")
    p.add_argument("--repeats", type=int, default=5)
    # the KV geometry of the built-in model (SmolLM2-135M-Instruct): 5.6 MiB bf16 chunks
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--tiers",
        nargs="+",
        default=list(TIERS),
        choices=TIERS,
        help="Tiers to measure (default: all three).",
    )
    p.add_argument("--dir", default=None, help="Directory for the disk tier (default: a temp dir).")
    p.add_argument(
        "--redis-url",
        default=None,
        help="redis://host:port (default: start a private redis-server).",
    )
    p.add_argument(
        "--skip-model-kv", action="store_true", help="Skip capturing KV of the built-in model."
    )
    return parse_with_smoke(p, argv, SMOKE)


def best_gbps(
    run: Callable[[], None], before: Callable[[], None], nbytes: int, repeats: int
) -> float:
    best = float("inf")
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def paired_gbps(reference: Measure, store: Measure, nbytes: int, repeats: int) -> Figures:
    """Best GB/s of a reference and of the store, and the median of their per-round
    ratios. Runs alternate, reference then store, so that each pair sees the same
    machine weather (on a shared machine bandwidth swings several-fold minute to minute)."""
    refs, stores = [], []
    for _ in range(repeats):
        refs.append(best_gbps(*reference, nbytes=nbytes, repeats=1))
        stores.append(best_gbps(*store, nbytes=nbytes, repeats=1))
    return (
        max(refs),
        max(stores),
        statistics.median(s / r for s, r in zip(stores, refs, strict=True)),
    )


def empty(store: TieredStore, tier: str) -> None:
    """Drop every record of `tier` and wait until it is done: `flush` only starts the clear
    (it runs on the store's upkeep thread), and a clear still running when the next put round
    starts deletes records just saved, so that a get finds chunks missing (seen on a loaded
    machine: `store --smoke` exited 1, "a chunk failed to load")."""
    store.flush([tier]).result(600)
    store.manager.poll()  # the index forgets the removed records


def batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Workload:
    """The chunks, their keys and output buffers shared by every tier's measurement. The
    chunks are the consecutive records of one long sequence, so that a batch of them is
    one `locate` + `open_load`, as the engine loads a request."""

    def __init__(self, spec: ChunkSpec, chunks: int, batch: int, repeats: int) -> None:
        self.spec, self.batch, self.repeats = spec, batch, repeats
        gen = torch.Generator().manual_seed(0)
        self.payloads = [
            torch.randn(spec.shape, generator=gen).to(spec.dtype) for _ in range(chunks)
        ]
        self.outs = [torch.empty(spec.shape, dtype=spec.dtype) for _ in range(chunks)]
        per = spec.blocks_per_chunk
        self.hashes = [hashlib.sha256(f"bench-{i}".encode()).digest() for i in range(chunks * per)]
        self.nbytes = chunks * spec.nbytes

    def keys(self, store: TieredStore) -> list:
        per = self.spec.blocks_per_chunk
        return [store.manager.key(self.hashes[s : s + per], s) for s in range(0, len(self.hashes), per)]

    def save_all(self, store: TieredStore) -> None:
        futures = [
            save_tensors(store, k, t)
            for k, t in zip(
                batches(self.keys(store), self.batch), batches(self.payloads, self.batch), strict=True
            )
        ]
        if not all(f.result(600).complete for f in futures):
            raise RuntimeError("the store did not keep every chunk; raise its capacity")

    def load_all(self, store: TieredStore, copy_out: bool) -> None:
        """Open a load per batch of records, as the engine does for a request: the
        records are in host slots, verified, when it is done. `copy_out`: copy them into
        the output tensors too (what the engine's device copy does from the cpu tier)."""
        span = self.batch * self.spec.blocks_per_chunk
        for start in range(0, len(self.hashes), span):
            load = store.transfers.open_load(store.manager.locate(self.hashes, start, start + span))
            load.wait(600)
            if load.arrived_blocks() != min(span, len(self.hashes) - start):
                raise RuntimeError("a chunk failed to load")
            if copy_out:
                first = start // self.spec.blocks_per_chunk
                for index, part in enumerate(load.parts):
                    host_copy(self.outs[first + index], store.transfers.view(part))
            store.transfers.close_load(load)

    def check_outputs(self, store: TieredStore) -> None:
        self.load_all(store, copy_out=True)
        for out, payload in zip(self.outs, self.payloads, strict=True):
            if not torch.equal(out.view(torch.uint8), payload.view(torch.uint8)):
                raise RuntimeError("loaded bytes differ from saved bytes")

    def put_get(
        self,
        store: TieredStore,
        tier: str,
        put_reference: Callable[[], None],
        get_reference: Callable[[], None],
    ) -> tuple[Figures, Figures]:
        """Put and get figures of `store` (its one tier `tier`, emptied before every put
        round) paired with references that need no setup; checks the loaded bytes and
        closes the store."""
        try:
            puts = paired_gbps(
                (put_reference, NOTHING),
                (lambda: self.save_all(store), lambda: empty(store, tier)),
                self.nbytes,
                self.repeats,
            )
            gets = paired_gbps(
                (get_reference, NOTHING),
                (lambda: self.load_all(store, copy_out=tier == "cpu"), NOTHING),
                self.nbytes,
                self.repeats,
            )
            self.check_outputs(store)
        finally:
            store.close()
        return puts, gets


def row(tier: str, reference: str, puts: Figures, gets: Figures) -> dict:
    return {
        "tier": tier,
        "reference": reference,
        "ref_put_gbps": puts[0],
        "put_gbps": puts[1],
        "put_ratio": puts[2],
        "ref_get_gbps": gets[0],
        "get_gbps": gets[1],
        "get_ratio": gets[2],
    }


def bench_cpu(w: Workload) -> dict:
    def memcpy() -> None:
        for src, dst in zip(w.payloads, w.outs, strict=True):
            host_copy(dst, src)

    config = StoreConfig(kv_offload="cpu", kv_offload_cpu_size=f"{w.nbytes + len(w.payloads) * 8192}B")
    store = TieredStore.from_config(w.spec, config)
    puts, gets = w.put_get(store, "cpu", memcpy, memcpy)
    return row("cpu", "memcpy", puts, gets)


def drop_page_cache(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(w: Workload, root: Path) -> dict:
    raw = root / "raw.bin"
    views = [tensor_bytes(p) for p in w.payloads]

    def raw_write() -> None:
        with open(raw, "wb", buffering=0) as f:
            for view in views:
                f.write(view)
            os.fsync(f.fileno())

    def raw_read() -> None:
        with open(raw, "rb", buffering=0) as f:
            for out in w.outs:
                f.readinto(tensor_bytes(out))

    config = StoreConfig(kv_offload="disk", kv_offload_disk_path=str(root / "store"),
                         kv_offload_disk_size=f"{4 * w.nbytes}B", kv_max_pending_writes=f"{2 * w.nbytes}B")
    store = TieredStore.from_config(w.spec, config, staging_size=len(w.payloads) * (w.spec.nbytes + 8192))

    def save_synced() -> None:
        w.save_all(store)
        os.sync()

    def drop_store_cache() -> None:
        drop_page_cache(list((root / "store").rglob("*.kvc")))

    try:
        puts = paired_gbps(
            (raw_write, lambda: raw.unlink(missing_ok=True)),
            (save_synced, lambda: empty(store, "disk")),
            w.nbytes,
            w.repeats,
        )
        gets = paired_gbps(
            (raw_read, lambda: drop_page_cache([raw])),
            (lambda: w.load_all(store, copy_out=False), drop_store_cache),
            w.nbytes,
            w.repeats,
        )
        warm = paired_gbps(
            (raw_read, NOTHING), (lambda: w.load_all(store, copy_out=False), NOTHING), w.nbytes, w.repeats
        )
        w.check_outputs(store)
    finally:
        store.close()
        raw.unlink(missing_ok=True)
    result = row("disk", "sequential file write+fsync / cold read", puts, gets)
    result.update(ref_get_warm_gbps=warm[0], get_warm_gbps=warm[1], get_warm_ratio=warm[2])
    return result


class RawRedis:
    """Just enough RESP over a socket to SET and GET big values, pipelined."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def set_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        for key, value in items:
            self.sock.sendall(
                b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, value.nbytes)
            )
            self.sock.sendall(value)
            self.sock.sendall(b"\r\n")
        for _ in items:
            if self._line() != b"+OK":
                raise RuntimeError("raw SET failed")

    def get_many(self, keys: list[bytes], outs: list[memoryview]) -> None:
        self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        for out in outs:
            if int(self._line()[1:]) != out.nbytes:
                raise RuntimeError("raw GET returned an unexpected length")
            self._read_into(out)
            self._read_into(memoryview(bytearray(2)))

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        line, _, rest = bytes(self.buf).partition(b"\r\n")
        self.buf = bytearray(rest)
        return line

    def _read_into(self, out: memoryview) -> None:
        have = min(len(self.buf), out.nbytes)
        out[:have] = self.buf[:have]
        del self.buf[:have]
        while have < out.nbytes:
            got = self.sock.recv_into(out[have:])
            if not got:
                raise RuntimeError("redis closed the connection")
            have += got


def bench_redis(w: Workload, url: str) -> dict:
    host, port = url.split("://")[1].split("/")[0].rsplit(":", 1)
    raw = RawRedis(host, int(port))
    keys = [b"rawbench:" + h.hex().encode() for h in w.hashes[:: w.spec.blocks_per_chunk]]
    views = [tensor_bytes(p) for p in w.payloads]
    outs = [tensor_bytes(o) for o in w.outs]

    def raw_put() -> None:
        for kb, vb in zip(batches(keys, w.batch), batches(views, w.batch), strict=True):
            raw.set_many(list(zip(kb, vb, strict=True)))

    def raw_get() -> None:
        for kb, ob in zip(batches(keys, w.batch), batches(outs, w.batch), strict=True):
            raw.get_many(kb, ob)

    config = StoreConfig(kv_offload="redis", kv_redis_url=url, kv_max_pending_writes=f"{2 * w.nbytes}B")
    store = TieredStore.from_config(w.spec, config, staging_size=len(w.payloads) * (w.spec.nbytes + 8192))
    try:
        puts, gets = w.put_get(store, "redis", raw_put, raw_get)
    finally:
        raw.sock.close()
    return row("redis", "raw-socket RESP SET/GET, same batches", puts, gets)


def model_kv_chunks(spec: ChunkSpec, tokens: int) -> torch.Tensor:
    """KV of the built-in default model for `tokens` tokens of real text, fp32, in chunk
    layout [chunks, blocks, layers, 2, block, heads, head_dim]."""
    from transformers import AutoModelForCausalLM

    from bench.text_corpus import token_documents
    from engine.builtin_models import resolve_model
    from engine.models import load_tokenizer

    path = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([token_documents(load_tokenizer(path), [tokens], seed=1)[0]])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = [
        torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers
    ]  # [2, heads, seq, dim]
    kv = torch.stack(layers)  # [layers, 2, heads, seq, dim]
    blocks_per_chunk, layers_n, _, block, heads, dim = spec.shape
    kv = kv.reshape(layers_n, 2, heads, tokens // spec.chunk_tokens, blocks_per_chunk, block, dim)
    return kv.permute(3, 4, 0, 1, 5, 2, 6).contiguous()


def synthetic_chunks(spec: ChunkSpec, count: int, smooth: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    shape = (count, *spec.shape)
    if not smooth:
        return torch.randn(shape, generator=gen)
    channel_scale = torch.exp(torch.randn(shape[-1], generator=gen))  # per-channel magnitudes
    positions = torch.arange(spec.chunk_tokens * count, dtype=torch.float32)
    signal = torch.sin(positions[:, None] / 50 + torch.rand(shape[-1], generator=gen) * 6.28)
    signal = signal.reshape(count, shape[1], 1, 1, shape[4], 1, shape[-1])
    noise = 0.05 * torch.randn(shape, generator=gen)
    return (signal + noise) * channel_scale


def bench_codecs(payloads: dict[str, torch.Tensor], repeats: int) -> list[dict]:
    rows = []
    for source, values in payloads.items():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            chunks = [tensor_bytes(c) for c in values.to(dtype)]
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = sum(c.nbytes for c in chunks)
            for codec in (Codec.LZ4, Codec.LZ4_PLANES):
                rows.append(_codec_row(source, dtype, codec, chunks, itemsize, nbytes, repeats))
    return rows


def _codec_row(
    source: str,
    dtype: torch.dtype,
    codec: Codec,
    chunks: list[memoryview],
    itemsize: int,
    nbytes: int,
    repeats: int,
) -> dict:
    packed: list[bytes] = []

    def encode() -> None:
        packed[:] = [b"".join(encode_segments(codec, c, itemsize)) for c in chunks]

    encode_gbps = best_gbps(encode, NOTHING, nbytes, repeats)
    out = memoryview(bytearray(chunks[0].nbytes))

    def decode() -> None:
        for p in packed:
            decompress_into(codec, memoryview(p), out, itemsize)

    decode_gbps = best_gbps(decode, NOTHING, nbytes, repeats)
    return {
        "payload": source,
        "dtype": str(dtype).removeprefix("torch."),
        "codec": codec.value,
        "ratio": nbytes / sum(len(p) for p in packed),
        "compress_mbps": encode_gbps * 1000,
        "decompress_mbps": decode_gbps * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)  # `python -m bench.store` as well
    args = parse_args(argv)
    spec = ChunkSpec.for_kv_layout(
        hashlib.sha256(b"bench-store").digest(),
        num_layers=args.layers,
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        chunk_tokens=args.chunk_tokens,
    )
    workload = Workload(spec, args.chunks, args.batch, args.repeats)
    result: dict = {
        **run_stamp(NAME, argv),
        "args": vars(args),
        "redis_parser": "hiredis" if HIREDIS_AVAILABLE else "python",
        "spec": {"shape": spec.shape, "dtype": args.dtype, "chunk_mib": spec.nbytes / MiB},
    }
    result["tiers"] = []
    if "cpu" in args.tiers:
        result["tiers"].append(bench_cpu(workload))
    if "disk" in args.tiers:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            result["tiers"].append(bench_disk(workload, Path(tmp)))
    if "redis" in args.tiers:
        with local_redis(args.redis_url) as url:
            result["tiers"].append(bench_redis(workload, url))
    sources = {
        "gaussian (random values)": synthetic_chunks(spec, 8, smooth=False),
        "smooth synthetic": synthetic_chunks(spec, 8, smooth=True),
    }
    if not args.skip_model_kv:
        sources = {
            "built-in model KV (SmolLM2, real text)": model_kv_chunks(spec, 8 * spec.chunk_tokens),
            **sources,
        }
    result["compression"] = bench_codecs(sources, args.repeats)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    spec, args = result["spec"], result["args"]
    # older results have "load_average" only
    load = result.get("load_average_start") or result["load_average"]
    lines = [
        f"### Store throughput per tier ({spec['chunk_mib']:.3g} MiB chunks, batches of "
        f"{args['batch']}, {args['chunks']} chunks, best of {args['repeats']}; "
        f"redis-py parser: {result['redis_parser']}; load average at start {load[0]:.1f})\n"
    ]
    headers = [
        "tier",
        "reference",
        "ref put GB/s",
        "ref get GB/s",
        "put GB/s",
        "get GB/s",
        "put/ref (median)",
        "get/ref (median)",
    ]
    rows = [
        [
            r["tier"],
            r["reference"],
            r["ref_put_gbps"],
            r["ref_get_gbps"],
            r["put_gbps"],
            r["get_gbps"],
            f"{r['put_ratio']:.0%}",
            f"{r['get_ratio']:.0%}",
        ]
        for r in result["tiers"]
    ]
    lines.append(markdown_table(headers, rows))
    disk = _tier(result, "disk")
    if disk:
        lines.append(
            f"\ndisk with a warm page cache: raw read {disk['ref_get_warm_gbps']:.3g} GB/s, "
            f"store get {disk['get_warm_gbps']:.3g} GB/s (median ratio {disk['get_warm_ratio']:.0%}).\n"
        )
    lines.append("\n### lz4 on KV payloads (ratio = raw / compressed; MB/s of raw bytes)\n")
    headers = ["payload", "dtype", "codec", "ratio", "compress MB/s", "decompress MB/s"]
    rows = [
        [
            c["payload"],
            c["dtype"],
            c["codec"],
            f"{c['ratio']:.3f}",
            c["compress_mbps"],
            c["decompress_mbps"],
        ]
        for c in result["compression"]
    ]
    lines.append(markdown_table(headers, rows))
    return "\n".join(lines)


def _tier(result: dict, name: str) -> dict | None:
    return next((r for r in result["tiers"] if r["tier"] == name), None)


def _short(payload: str) -> str:
    """A payload's name without its parenthesis, for plot labels."""
    return payload.split(" (")[0]


def plot(result: dict) -> None:
    tiers = {r["tier"]: r for r in result["tiers"]}
    names = list(tiers)
    gbps = {
        f"{op}, {side}": [r[f"{prefix}{op}_gbps"] for r in tiers.values()]
        for op in ("put", "get")
        for side, prefix in (("reference", "ref_"), ("store", ""))
    }
    ratios = {op: [100 * r[f"{op}_ratio"] for r in tiers.values()] for op in ("put", "get")}
    if "disk" in tiers:
        ratios["get, warm page cache"] = [
            100 * r.get("get_warm_ratio", float("nan")) for r in tiers.values()
        ]
    payloads = list(dict.fromkeys(c["payload"] for c in result["compression"]))
    lz4: dict[str, list[float]] = {"lz4-plain, best dtype": [0.0] * len(payloads)}
    for c in result["compression"]:
        at = payloads.index(c["payload"])
        if c["codec"] == Codec.LZ4.value:
            lz4["lz4-plain, best dtype"][at] = max(lz4["lz4-plain, best dtype"][at], c["ratio"])
        else:
            lz4.setdefault(f"{c['codec']}, {c['dtype']}", [float("nan")] * len(payloads))[at] = c[
                "ratio"
            ]
    plots.save_figure(
        plots.png_path(NAME),
        [
            plots.Panel("Throughput (best run)", "tier", "GB/s", names, gbps, kind="bar"),
            plots.Panel(
                "Store / reference (median of paired runs)",
                "tier",
                "% of the reference",
                names,
                ratios,
                kind="bar",
                hlines={f"target {TARGET:.0%}": 100 * TARGET, "100%": 100},
            ),
            plots.Panel(
                "lz4 on KV payloads",
                "payload",
                "raw / compressed",
                [_short(p) for p in payloads],
                lz4,
                kind="bar",
                hlines={"no gain": 1.0},
            ),
        ],
        "KV store: put/get per tier against raw references, and lz4",
    )


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    args = result["args"]
    text = (
        f"Each store figure is paired with a reference that moves the same {args['chunks']} chunks "
        f"({result['spec']['chunk_mib']:.3g} MiB each, {args['batch']} per call) in the same run, "
        f"the two alternating run by run; GB/s are the best of {args['repeats']} runs and the "
        "ratio is the median of the per-run ratios, steadier than either figure when the shared "
        "machine's bandwidth swings. Against the targets (store get at least "
        f"{TARGET:.0%} of its reference, put at least {PUT_TARGET:.0%}): " + "; ".join(map(_verdict, result["tiers"])) + ". "
    )
    return (text + _where_time_goes(result) + _compression_sentences(result)).strip()


def _verdict(r: dict) -> str:
    figures = " and ".join(
        f"{op} {r[f'{op}_ratio']:.0%} ({r[f'{op}_gbps']:.2g} vs {r[f'ref_{op}_gbps']:.2g} GB/s)"
        for op in ("put", "get")
    )
    missed = [op for op, line in (("put", PUT_TARGET), ("get", TARGET)) if r[f"{op}_ratio"] < line]
    return f"{r['tier']} {figures}: " + (f"misses on {' and '.join(missed)}" if missed else "meets")


def _where_time_goes(result: dict) -> str:
    text = ""
    cpu, disk, redis = (_tier(result, name) for name in ("cpu", "disk", "redis"))
    if cpu:
        text += (
            "The cpu tier does what its reference does, one memcpy per chunk into its slab (put) "
            "or out of it (get), plus per-call bookkeeping (keys, futures, slab slots) that weighs "
            "most on small chunks, so on a quiet machine both ratios would be a little under 100% "
            f"(here put {cpu['put_ratio']:.0%}, get {cpu['get_ratio']:.0%})"
        )
        above = [op for op in ("put", "get") if cpu[f"{op}_ratio"] > 1.1]
        text += (
            f"; {' and '.join(above)} above 100% can only be the shared machine swinging between "
            "the paired runs, since the store does at least the copy. "
            if above
            else ". "
        )
    if disk:
        text += (
            "The disk tier writes one record file per chunk (a temp file, then a rename) where "
            "the reference appends to one file, and reads each record with readinto straight "
            "into a host slot, checks its xxh3 there and copies the payload out to the caller's "
            "tensor (as the engine copies it to the device), where the reference only reads; "
            "a batch is read in up to 8 concurrent parts, each part checked while the others "
            "are still being read"
        )
        if "get_warm_ratio" in disk:
            text += (
                f": with a warm page cache, where no device hides that extra pass, the store gets "
                f"{disk['get_warm_gbps']:.2g} GB/s against a raw read's "
                f"{disk['ref_get_warm_gbps']:.2g} ({disk['get_warm_ratio']:.0%})"
            )
        text += ". "
    if redis:
        text += (
            f"On redis, gets reach {redis['get_ratio']:.0%} of the raw socket and puts "
            f"{redis['put_ratio']:.0%}: a get is a pipeline of GETRANGEs per part of the batch "
            "(up to 8, each over its own connection, where the reference uses one), whose "
            "replies are received with recv_into straight into host slots, checked there (xxh3) "
            "and copied out to the caller's tensor, where the reference only receives; puts go "
            "through redis-py's pipeline"
        )
        if result.get("redis_parser") == "python":
            text += (
                ", and redis-py parsed the replies in pure Python (hiredis not installed), "
                "allocating every recv and copying each reply through a buffer twice; with "
                "`redis[hiredis]` it parses them in C"
            )
        text += ". "
    return text


def _compression_sentences(result: dict) -> str:
    rows = result["compression"]
    plain = [c["ratio"] for c in rows if c["codec"] == Codec.LZ4.value]
    planes = [c for c in rows if c["codec"] == Codec.LZ4_PLANES.value]
    if not plain or not planes:
        return ""
    dtype = result["spec"]["dtype"]
    ours = [c for c in planes if c["dtype"] == dtype] or planes
    ratios = ", ".join(f"{_short(c['payload'])} {c['ratio']:.2f}x" for c in ours)
    compress = [c["compress_mbps"] / 1000 for c in ours]
    decompress = [c["decompress_mbps"] / 1000 for c in ours]
    text = (
        f"lz4 on the whole payload never shrinks KV (ratio {_span(plain, '.3f')}): interleaved "
        "mantissa bytes leave few repeats. On the sign/exponent byte plane alone it gives, in "
        f"{ours[0]['dtype']}, {ratios}, compressing at {_span(compress, '.2g')} GB/s and "
        f"decompressing at {_span(decompress, '.2g')} GB/s on one core. "
    )
    puts = {r["tier"]: r["put_gbps"] for r in result["tiers"] if r["tier"] != "cpu"}
    if not puts:
        return text
    slowest = min(puts, key=puts.get)
    where = f"the slowest record tier's put here ({slowest}, {puts[slowest]:.2g} GB/s)"
    if min(compress) >= puts[slowest]:
        return text + (
            f"That is not slower than {where}, so a tier that slow could gain up to the ratio in "
            "throughput; compression also fits more KV in a byte budget. "
        )
    if max(compress) < puts[slowest]:
        verdict = f"That is slower than {where}: on this machine compression costs throughput"
    else:
        verdict = (
            f"That range brackets {where}: compression gains throughput here only where it "
            "overlaps the tier's I/O on another core"
        )
    return text + (
        f"{verdict}; it pays where a tier moves bytes more slowly than the compressor (a network "
        "Redis, a slow disk) or to fit more KV in a byte budget. "
    )


def _span(values: list[float], spec: str) -> str:
    """'a-b' of the smallest and largest value, or one value when they print the same."""
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}-{high}"


if __name__ == "__main__":
    raise SystemExit(main())
