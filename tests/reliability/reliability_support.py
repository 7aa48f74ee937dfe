"""Shared pieces of the reliability tests: workloads, an engine driver that times every
step, the cold-run oracle, a model wrapper that fails on a poison token, real server and
worker processes, and validation of stored records."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from kvstore import ChunkKey, ChunkSpec, RecordError, TieredStore
from kvstore.record import HEADER_SIZE, RecordCodec
from kvstore.spec import tensor_bytes
from tests.server.server_helpers import ServerProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHUNK = 32  # tokens per stored chunk: two blocks of 16
ADMIN_TOKEN = "reliability-admin-token-0123456789"
BODY_READ_TIMEOUT_S = 2.0  # the fault server's --body-read-timeout
BODY_READS_PER_CLIENT = 8  # its --max-body-reads-per-client
VOCAB = 480
POISON_TOKEN = 3  # never drawn by random_prompts: the poisoned model fails on it ...
POISON_AT = 40  # ... at this position (always inside the prompt: greedy outputs may hold 3)
NAN_TOKEN = 2  # never drawn either: at POISON_AT, the poisoned model returns NaN hidden states
GARBAGE = 7.0  # what the poisoned model leaves in the KV it was computing, by default
REDIS_PREFIX = "kvtier:"  # StoreConfig.redis_key_prefix
ENGINE = {"dtype": "float32", "kv_chunk_tokens": CHUNK, "num_kv_blocks": 64}
STORE_ONLY = {**ENGINE, "enable_prefix_caching": False}  # every reuse goes through the store
RECORD_BYTES = HEADER_SIZE + CHUNK * 2 * 2 * 2 * 16 * 4  # a record of the tiny fp32 model
COLD = {"dtype": "float32", "num_kv_blocks": 256, "enable_prefix_caching": False}
_ids = itertools.count()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(POISON_TOKEN + 1, VOCAB) for _ in range(length)] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def wrong_outputs(got: list[list[int]], want: list[list[int]]) -> int:
    assert len(got) == len(want)
    return sum(g != w for g, w in zip(got, want, strict=True))


# ---- driving an engine -------------------------------------------------------------------


@dataclass
class Run:
    """What `drive` saw: per request (in prompt order) its tokens, finish reason, error,
    latency and cached tokens; and the wall time of every engine step."""

    ids: list[str]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    errors: dict[str, str | None] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    first_token_s: dict[str, float] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)

    @property
    def outputs(self) -> list[list[int]]:
        return [self.tokens[i] for i in self.ids]

    @property
    def max_step_s(self) -> float:
        return max(self.step_s, default=0.0)


def drive(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    salt: str | None = None,
    on_step: Callable[[int], None] | None = None,
    deadline_s: float = 120.0,
) -> Run:
    """Add every prompt, then step the engine until all finish (`on_step(n)` after step n)."""
    run = Run([f"rel-{next(_ids)}" for _ in prompts])
    for rid, prompt in zip(run.ids, prompts, strict=True):
        engine.add_request(rid, prompt, greedy(max_tokens), cache_salt=salt)
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests in time"
        started = time.perf_counter()
        outputs = engine.step()
        run.step_s.append(time.perf_counter() - started)
        for output in outputs:
            if output.finished:
                _record(run, output)
        if on_step is not None:
            on_step(len(run.step_s))
    return run


def _record(run: Run, output: Any) -> None:
    rid, metrics = output.request_id, output.metrics
    run.tokens[rid] = list(output.outputs[0].token_ids)
    run.texts[rid] = output.outputs[0].text
    run.finish[rid] = output.outputs[0].finish_reason
    run.errors[rid] = output.error
    run.latency_s[rid] = metrics.finish_time - metrics.arrival_time
    run.first_token_s[rid] = metrics.time_to_first_token
    run.cached[rid] = metrics.num_cached_tokens


class ColdOracle:
    """Greedy tokens (and text) of a cold run: an engine per model with no offload and
    no prefix cache. Prompts not computed before are served together in one batch."""

    def __init__(self) -> None:
        self._engines: dict[str, LLM] = {}
        self._memo: dict[tuple, tuple[list[int], str]] = {}

    def __call__(self, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [tokens for tokens, _ in self._answers(model, prompts, max_tokens)]

    def texts(self, model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
        return [text for _, text in self._answers(model, prompts, max_tokens)]

    def _answers(self, model: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], str]]:
        keys = [(model, tuple(p), max_tokens) for p in prompts]
        todo = list(dict.fromkeys(k for k in keys if k not in self._memo))
        if todo:
            if model not in self._engines:
                self._engines[model] = LLM(model=model, **COLD)
            run = drive(self._engines[model].engine, [list(k[1]) for k in todo], max_tokens)
            for key, rid in zip(todo, run.ids, strict=True):
                self._memo[key] = (run.tokens[rid], run.texts[rid])
        return [self._memo[k] for k in keys]


# ---- the store behind an engine ----------------------------------------------------------


def store_of(engine: LLMEngine) -> TieredStore:
    return engine.connector.store


def tier(engine: LLMEngine, name: str) -> dict[str, Any]:
    return engine.kv_store_stats()[name]


def held_blocks(engine: LLMEngine) -> int:
    """Device blocks held by requests (none once the engine is idle)."""
    stats = engine.stats()
    return round(stats["kv_cache_usage_perc"] * stats["num_kv_blocks"])


def numeric_stats(engine: LLMEngine) -> dict[str, float]:
    return {k: v for k, v in engine.stats().items() if isinstance(v, int | float)}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def rejected(stats: dict[str, Any]) -> int:
    """Records a tier refused to use, whatever the reason."""
    return stats["checksum_failures"] + stats["auth_failures"] + stats["rejected_records"]


def chunk_keys(engine: LLMEngine, prompt: list[int], salt: str | None = None) -> list[ChunkKey]:
    """The store keys of a prompt's full chunks."""
    hashes = engine.block_hasher.hashes(prompt, salt)
    return store_of(engine).manager.chunk_keys(hashes, engine.config.block_size)


def missing_chunks(engine: LLMEngine, prompt: list[int], salt: str | None = None) -> int:
    """Full chunks of `prompt` that the store's lookup does not find."""
    keys = chunk_keys(engine, prompt, salt)
    return len(keys) - store_of(engine).manager.lookup(keys).num_chunks


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> float:
    """Seconds until `condition()` held; fails the test after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(poll_s)
    return time.monotonic() - started


# ---- records -----------------------------------------------------------------------------


def bytes_on_disk(root: Path, attempts: int = 200) -> int:
    """The bytes of record and temporary files under `root` at one moment.

    One walk is not a snapshot: a file evicted from a directory the walk has already
    listed and its replacement written to one it lists later are both counted. Two walks
    in a row that find the same files of the same sizes are one: each directory held
    those files from its first listing to its second, so all of them together did between
    the end of the first walk and the start of the second. Walks are repeated until two
    agree; AssertionError if none do in `attempts`."""
    previous = _file_sizes(root)
    for _ in range(attempts):
        current = _file_sizes(root)
        if current == previous:
            return sum(current.values())
        previous = current
    raise AssertionError(f"the files under {root} never held still for two walks")


def _file_sizes(root: Path) -> dict[Path, int]:
    sizes = {}
    for path in root.rglob("*"):
        try:
            if path.is_file():
                sizes[path] = path.stat().st_size
        except FileNotFoundError:
            continue
    return sizes


def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvc"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def block_hash_of(key: str) -> bytes:
    """The block hash at the end of a tier key `<fingerprint>-<chunk>-<hash>`."""
    return bytes.fromhex(key.rsplit("-", 1)[1])


def record_is_valid(codec: RecordCodec, key: str, record: bytes) -> bool:
    out = torch.empty(codec.spec.shape, dtype=codec.spec.dtype)
    try:
        codec.decode_into(block_hash_of(key), record, tensor_bytes(out))
    except RecordError:
        return False
    return True


def invalid_disk_records(codec: RecordCodec, root: Path) -> list[Path]:
    """Record files of `codec`'s model under `root` that do not validate."""
    prefix = codec.spec.fingerprint.hex()
    files = [p for p in record_files(root) if p.name.startswith(prefix)]
    return [p for p in files if not record_is_valid(codec, p.stem, p.read_bytes())]


def engine_codec(engine: LLMEngine, secret: bytes | None = None) -> RecordCodec:
    """A codec for the engine's records (uncompressed encoder, any record decodes)."""
    return RecordCodec(store_of(engine).spec, secret=secret)


def spec_for(engine: LLMEngine) -> ChunkSpec:
    return store_of(engine).spec


# ---- a model that fails on a poison token ------------------------------------------------


class PoisonedModel(torch.nn.Module):
    """The real model, except that a step holding POISON_TOKEN at position POISON_AT
    overwrites the KV slots of the requests holding it with `garbage` (what a fault
    mid-forward leaves behind; NaN for a numerical blow-up) and raises; and a step holding
    NAN_TOKEN at POISON_AT returns NaN hidden states for the requests holding it (their
    logits are NaN; their KV is the real one), without raising."""

    def __init__(self, inner: torch.nn.Module, garbage: float = GARBAGE) -> None:
        super().__init__()
        self.inner = inner
        self.garbage = garbage

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        hidden = self.inner(input_ids, positions, kv_cache, meta)
        poisoned = ((input_ids == POISON_TOKEN) & (positions == POISON_AT)).nonzero().flatten()
        if len(poisoned):
            self._spoil(poisoned, kv_cache, meta, self.garbage)
            raise RuntimeError("poisoned token in the batch")
        for row in ((input_ids == NAN_TOKEN) & (positions == POISON_AT)).nonzero().flatten().tolist():
            hidden[self._rows_of(row, meta)] = float("nan")
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    def pack_weights(self) -> bool:
        return self.inner.pack_weights()

    def fuse_large_steps(self) -> None:
        self.inner.fuse_large_steps()

    @staticmethod
    def _rows_of(row: int, meta: Any) -> slice:
        """The rows of the step's flattened batch that belong to `row`'s sequence."""
        starts = meta.query_start_loc.tolist()
        seq = next(i for i in range(len(starts) - 1) if starts[i] <= row < starts[i + 1])
        return slice(starts[seq], starts[seq + 1])

    @classmethod
    def _spoil(cls, rows: torch.Tensor, kv_cache: torch.Tensor, meta: Any, garbage: float) -> None:
        block_size = kv_cache.shape[3]
        for row in rows.tolist():
            for slot in meta.slot_mapping[cls._rows_of(row, meta)].tolist():
                kv_cache[slot // block_size, :, :, slot % block_size] = garbage


def poison(engine: LLMEngine, garbage: float = GARBAGE) -> None:
    engine.runner.model = PoisonedModel(engine.runner.model, garbage)


# ---- processes ---------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(HERE)])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def without_dac_override() -> list[str]:
    """A command prefix under which root obeys file permissions (empty for other users)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return []
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner"]


def spawn(script: str, spec: dict, prefix: Iterable[str] = ()) -> subprocess.Popen:
    """Run `python tests/reliability/<script> <spec as JSON>` with stdout piped."""
    command = [*prefix, sys.executable, str(HERE / script), json.dumps(spec)]
    return subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def last_json(process: subprocess.Popen, timeout_s: float = 240.0) -> dict:
    out, err = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


class FaultServer(ServerProcess):
    """`kvtier serve` with the poisoned model (fault_server.py) on a free loopback port."""

    def __init__(self, *flags: str) -> None:
        super().__init__(*flags, command=[sys.executable, str(HERE / "fault_server.py")], env=child_env())

    @property
    def disk_path(self) -> Path:
        return Path(self.flags[self.flags.index("--kv-offload-disk-path") + 1])
