"""The C++ CPU kernels (`cpu_ops.cpp`): decode attention straight from the paged cache,
the KV write, RMSNorm and a decode step's fp32 projections, each one pass in one call,
and a batch of byte copies spread over torch's threads.

Built with the machine's C++ compiler the first time a process needs them (`make
install` builds them: `python -m kvkernels`; about 30 s on 2 cores) and kept under `~/.cache/kvtier/extensions` (or `$KVTIER_EXTENSIONS_DIR`), in a folder
named by a digest of the source, the compiler flags, the torch version and the CPU's
instruction sets, since the build is tuned to the CPU it runs on (`-march=native`). A
build that fails (no compiler, say) logs one warning and `available()` is False from
then on: the dispatch in `kvkernels/__init__.py` runs the torch reference instead.

Prefill chunks keep the reference's flash-attention calls; this module's
`paged_attention` runs the single-token sequences of a step in one call of the C++
kernel and hands the rest to the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from kvkernels import reference
from kvkernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
LIBRARY = "kvtier_cpu.so"
# OpenMP as torch's own threads: at::parallel_for is inline, and its pragmas need -fopenmp;
# the libgomp it links is the one torch loaded already (one SONAME, one thread pool).
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: dict[str, bool] = {}  # "built": True once loaded, False once a build failed


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_directory() -> Path:
    """Where this source, built for this CPU and torch, lives."""
    root = os.environ.get("KVTIER_EXTENSIONS_DIR") or Path.home() / ".cache" / "kvtier" / "extensions"
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return Path(root) / f"kvtier_cpu_{digest.hexdigest()[:16]}"


def available() -> bool:
    """Whether the kernels are loaded, building them on the first call."""
    built = _state.get("built")
    if built is not None:
        return built
    with _lock:
        if "built" not in _state:
            _state["built"] = _load()
    return _state["built"]


def _load() -> bool:
    library = build_directory() / LIBRARY
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build_and_load(library.parent)
    except Exception as exc:  # no compiler, a read-only home: the reference runs instead
        log.warning("the C++ CPU kernels could not be built (%s); running the torch reference kernels",
                    _first_error(exc))
        return False
    return True


def _build_and_load(directory: Path) -> None:
    """Compile (and load) in a folder of this process's own, then rename it into place:
    processes that start together each build, with no shared lock file that a killed
    build would leave behind, and the first rename wins."""
    from torch.utils import cpp_extension

    scratch = directory.with_name(f"{directory.name}.build-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        cpp_extension.load(
            name="kvtier_cpu", sources=[str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
            build_directory=str(scratch), is_python_module=False, verbose=False,
        )
        with contextlib.suppress(OSError):  # another process got there first, with the same build
            scratch.rename(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _first_error(exc: Exception) -> str:
    """The compiler's first error line in a failed build's message, else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return next((line for line in lines if "error:" in line), lines[-1])


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """As `reference.write_kv`."""
    dtype = kv_layer.dtype
    torch.ops.kvtier_cpu.write_kv(kv_layer, key.to(dtype), value.to(dtype), slot_mapping.long().contiguous())


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """As `reference.paged_attention`: the single-token sequences in one C++ call, every
    prefill chunk through the reference's flash calls."""
    out = query.new_empty(query.shape)
    if 1 in meta.query_lens_cpu:
        torch.ops.kvtier_cpu.decode_attention(
            out, query, kv_layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )
    if meta.max_query_len > 1:
        reference.prefill_attention(query, kv_layer, meta, scale, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As `reference.rms_norm`, in one pass over rows of contiguous values (the 2-D
    activations of a layer); anything else (the per-head norms of Qwen3) runs there."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype:
        return reference.rms_norm(x, weight, eps)
    return torch.ops.kvtier_cpu.rms_norm(x, weight, eps)


def copy_runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """As `reference.copy_runs`, in one call split evenly over torch's threads."""
    torch.ops.kvtier_cpu.copy_runs(dsts, srcs)


# Up to this many rows of x, `skinny_linear` beats the BLAS GEMM at fp32 (docs/notes/skinny-linear.md).
SKINNY_ROWS = 8


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W^T (+ b)` for a few rows of x, one pass over the weight split over the threads."""
    return torch.ops.kvtier_cpu.skinny_linear(x, weight, bias)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """As `reference.apply_token_bitmask`, a row a thread, whole words at a time."""
    torch.ops.kvtier_cpu.apply_token_bitmask(logits, bitmask.contiguous(), rows.long())
