"""KV store throughput per tier against physical references, and lz4 on KV payloads.

Each tier's put and get throughput is measured for chunks of the default model (8 layers,
2 KV heads, head_dim 64, bf16, 256-token chunks = 1 MiB) in batches of 16 chunks (one
4,096-token request), against a reference measured in the same run on the same bytes:

- cpu:   torch memcpy of the same chunks (copy_ into preallocated tensors);
- disk:  one sequential file written then fsync'd, read back with the page cache dropped
         (posix_fadvise DONTNEED after fsync; the store's files get the same treatment);
- redis: raw-socket RESP SET/GET of the same bytes to the same redis-server, pipelined in
         the same batches, read with recv_into into preallocated buffers.

The best of --repeats runs is kept for every figure. Compression: lz4 on the whole
payload vs lz4 on the sign/exponent byte plane only, on (1) real KV of the built-in
random-weight default model, (2) Gaussian values, (3) a smooth synthetic payload.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from redis.utils import HIREDIS_AVAILABLE

from bench.common import machine_info, markdown_table, write_result
from bench.kv_common import local_redis
from kvstore import ChunkSpec, TieredStore
from kvstore.compression import Codec, decompress_into, encode_segments
from kvstore.spec import tensor_bytes

MiB = 1024**2
Measure = tuple[Callable[[], None], Callable[[], None]]  # (timed run, untimed setup)
Figures = tuple[float, float, float]  # best reference GB/s, best store GB/s, median ratio


def NOTHING() -> None:
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtier bench store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chunks", type=int, default=256, help="Chunks per measurement (default 256).")
    p.add_argument("--batch", type=int, default=16, help="Chunks per store call / pipeline.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dir", default=None, help="Directory for the disk tier (default: a temp dir).")
    p.add_argument(
        "--redis-url",
        default=None,
        help="redis://host:port (default: start a private redis-server).",
    )
    p.add_argument(
        "--skip-model-kv", action="store_true", help="Skip capturing KV of the built-in model."
    )
    return p.parse_args(argv)


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


def batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Workload:
    """The chunks, their keys and output buffers shared by every tier's measurement."""

    def __init__(self, spec: ChunkSpec, chunks: int, batch: int, repeats: int) -> None:
        self.spec, self.batch, self.repeats = spec, batch, repeats
        gen = torch.Generator().manual_seed(0)
        self.payloads = [
            torch.randn(spec.shape, generator=gen).to(spec.dtype) for _ in range(chunks)
        ]
        self.outs = [torch.empty(spec.shape, dtype=spec.dtype) for _ in range(chunks)]
        self.hashes = [hashlib.sha256(f"bench-{i}".encode()).digest() for i in range(chunks)]
        self.nbytes = chunks * spec.nbytes

    def save_all(self, store: TieredStore) -> None:
        keys = [store.key(h) for h in self.hashes]
        futures = [
            store.save(k, t)
            for k, t in zip(
                batches(keys, self.batch), batches(self.payloads, self.batch), strict=True
            )
        ]
        if not all(f.result(600).complete for f in futures):
            raise RuntimeError("the store did not keep every chunk; raise its capacity")

    def load_all(self, store: TieredStore) -> None:
        keys = [store.key(h) for h in self.hashes]
        futures = [
            store.load(k, o)
            for k, o in zip(batches(keys, self.batch), batches(self.outs, self.batch), strict=True)
        ]
        if not all(all(f.result(600).ok) for f in futures):
            raise RuntimeError("a chunk failed to load")

    def check_outputs(self) -> None:
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
                (lambda: self.save_all(store), lambda: store.flush([tier])),
                self.nbytes,
                self.repeats,
            )
            gets = paired_gbps(
                (get_reference, NOTHING),
                (lambda: self.load_all(store), NOTHING),
                self.nbytes,
                self.repeats,
            )
            self.check_outputs()
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
            dst.copy_(src)

    store = TieredStore.from_options(w.spec, tiers="cpu", cpu_size=w.nbytes)
    puts, gets = w.put_get(store, "cpu", memcpy, memcpy)
    return row("cpu", "torch memcpy", puts, gets)


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

    store = TieredStore.from_options(
        w.spec,
        tiers="disk",
        disk_path=str(root / "store"),
        disk_size=4 * w.nbytes,
        max_pending_write_bytes=2 * w.nbytes,
    )

    def save_synced() -> None:
        w.save_all(store)
        os.sync()

    def drop_store_cache() -> None:
        drop_page_cache(list((root / "store").rglob("*.kvc")))

    try:
        puts = paired_gbps(
            (raw_write, lambda: raw.unlink(missing_ok=True)),
            (save_synced, lambda: store.flush(["disk"])),
            w.nbytes,
            w.repeats,
        )
        gets = paired_gbps(
            (raw_read, lambda: drop_page_cache([raw])),
            (lambda: w.load_all(store), drop_store_cache),
            w.nbytes,
            w.repeats,
        )
        warm = paired_gbps(
            (raw_read, NOTHING), (lambda: w.load_all(store), NOTHING), w.nbytes, w.repeats
        )
        w.check_outputs()
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
    keys = [b"rawbench:" + h.hex().encode() for h in w.hashes]
    views = [tensor_bytes(p) for p in w.payloads]
    outs = [tensor_bytes(o) for o in w.outs]

    def raw_put() -> None:
        for kb, vb in zip(batches(keys, w.batch), batches(views, w.batch), strict=True):
            raw.set_many(list(zip(kb, vb, strict=True)))

    def raw_get() -> None:
        for kb, ob in zip(batches(keys, w.batch), batches(outs, w.batch), strict=True):
            raw.get_many(kb, ob)

    store = TieredStore.from_options(
        w.spec, tiers="redis", redis_url=url, max_pending_write_bytes=2 * w.nbytes
    )
    try:
        puts, gets = w.put_get(store, "redis", raw_put, raw_get)
    finally:
        raw.sock.close()
    return row("redis", "raw-socket RESP SET/GET, same batches", puts, gets)


def model_kv_chunks(spec: ChunkSpec, tokens: int) -> torch.Tensor:
    """KV of the built-in default model (random weights) for random tokens, fp32,
    in chunk layout [chunks, blocks, layers, 2, block, heads, head_dim]."""
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = torch.randint(
        3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)
    )
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


def render(result: dict) -> str:
    spec = result["spec"]
    lines = [
        f"### Store throughput per tier ({spec['chunk_mib']:.2f} MiB chunks, batches of "
        f"{result['args']['batch']}, {result['args']['chunks']} chunks, best of {result['args']['repeats']}; "
        f"redis-py parser: {result['redis_parser']}; load average at start "
        f"{result['load_average'][0]:.1f})\n"
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
    disk = next((r for r in result["tiers"] if r["tier"] == "disk"), None)
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


def main(argv: list[str] | None = None) -> int:
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
        "machine": machine_info(),
        "args": vars(args),
        "load_average": os.getloadavg(),
        "redis_parser": "hiredis" if HIREDIS_AVAILABLE else "python",
        "spec": {"shape": spec.shape, "dtype": args.dtype, "chunk_mib": spec.nbytes / MiB},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        tiers = [bench_cpu(workload), bench_disk(workload, root)]
        with local_redis(args.redis_url) as url:
            tiers.append(bench_redis(workload, url))
    result["tiers"] = tiers
    sources = {
        "gaussian (random values)": synthetic_chunks(spec, 8, smooth=False),
        "smooth synthetic": synthetic_chunks(spec, 8, smooth=True),
    }
    if not args.skip_model_kv:
        sources = {
            "built-in model KV (random weights)": model_kv_chunks(spec, 8 * spec.chunk_tokens),
            **sources,
        }
    result["compression"] = bench_codecs(sources, args.repeats)
    markdown = render(result)
    write_result("store", result, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
