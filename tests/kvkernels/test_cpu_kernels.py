"""The C++ CPU kernels (kvkernels/cpu.py) against the naive fp32 oracle and the torch
reference, and the dispatch that picks them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvkernels
from kvkernels import cpu, reference
from tests.kvkernels.paged_batch import make_batch, naive_attention

ROOT = Path(__file__).resolve().parents[2]
# (query_len, seq_len) per sequence: decodes over contexts that end inside a block, on a
# block boundary, and span several of the kernel's 128-token partitions, beside prefills.
DECODES = [(1, 1), (1, 16), (1, 17), (1, 129), (1, 300), (1, 1000)]
MIXED = [(5, 21), (1, 40), (16, 16), (1, 7), (9, 33), (1, 300)]


def test_the_kernels_build_on_this_machine():
    # CI's machines have a C++ compiler: a failed build there is a bug, not a fallback.
    assert cpu.available()


@pytest.mark.parametrize("shapes", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 128), (8, 1, 64), (10, 2, 64), (6, 2, 80)],
    ids=["group3-d64", "group1-d128", "group8-d64", "group5-generic", "d80-generic"],
)
def test_attention_matches_naive(shapes, heads, kv_heads, head_dim):
    batch = make_batch(shapes, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    scale = head_dim**-0.5
    out = cpu.paged_attention(batch.query, batch.kv_layer, batch.meta, scale)
    torch.testing.assert_close(out, naive_attention(batch, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision_matches_the_reference(dtype):
    batch = make_batch(DECODES, heads=9, kv_heads=3, dtype=dtype)
    out = cpu.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)
    assert out.dtype == dtype
    expected = reference.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), naive_attention(batch, 0.125), atol=2e-2, rtol=2e-2)


def test_attention_reads_a_strided_query_and_layer_view():
    # As the model calls it: the query a slice of the fused QK rows, one layer of the cache.
    batch = make_batch(MIXED, heads=4, kv_heads=2)
    num_tokens = batch.query.shape[0]
    qk = torch.randn(num_tokens, 6, 64)
    qk[:, :4] = batch.query
    cache = torch.randn(batch.kv_layer.shape[0], 3, *batch.kv_layer.shape[1:])
    cache[:, 1] = batch.kv_layer
    out = cpu.paged_attention(qk[:, :4], cache[:, 1], batch.meta, 0.125)
    torch.testing.assert_close(out, naive_attention(batch, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_the_reference(dtype):
    cache = torch.randn(6, 3, 2, 4, 2, 8).to(dtype)
    expected = cache.clone()
    key, value = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    key[0, 1, 3], value[2, 0, 0], value[4, 1, 7] = float("nan"), float("inf"), float("-inf")
    slots = torch.tensor([5, 13, -1, 0, 23])
    cpu.write_kv(cache[:, 1], key, value, slots)
    reference.write_kv(expected[:, 1], key, value, slots)
    assert torch.equal(cache, expected)
    assert torch.isfinite(cache).all()


def test_write_kv_casts_to_the_cache_dtype():
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16)
    key = torch.randn(1, 1, 8)
    cpu.write_kv(cache, key, -key, torch.tensor([6]))
    assert torch.equal(cache[1, 0, 2], key[0].to(torch.bfloat16))
    assert torch.equal(cache[1, 1, 2], (-key[0]).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_the_reference(dtype):
    x = torch.randn(7, 576).to(dtype) * 3
    weight = torch.randn(576).to(dtype)
    out = cpu.rms_norm(x, weight, 1e-5)
    expected = reference.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:  # the sum of squares in another order: at most one rounding step apart
        torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2 ** -7)


def test_rms_norm_of_a_strided_head_view_runs_the_reference():
    x = torch.randn(5, 6, 64)[:, 2:4]  # Qwen3's per-head norm of a slice of heads
    weight = torch.randn(64)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


def test_auto_dispatches_cpu_tensors_to_the_cpp_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "write_kv", lambda *args: calls.append("cpu"))
    monkeypatch.setattr(reference, "write_kv", lambda *args: calls.append("torch"))
    args = (torch.zeros(1, 2, 4, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.tensor([0]))
    kvkernels.write_kv(*args)
    with kvkernels.use_backend("torch"):
        kvkernels.write_kv(*args)
    assert calls == ["cpu", "torch"]


def test_a_failed_build_falls_back_to_the_reference_with_one_warning(monkeypatch, caplog, tmp_path):
    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'kvtier_cpu'\nc++: error: no such file\nninja: stopped")

    monkeypatch.setenv("KVTIER_EXTENSIONS_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="kvkernels.cpu"):
        assert not cpu.available()
        assert not cpu.available()
    assert [r.getMessage() for r in caplog.records] == [
        "the C++ CPU kernels could not be built (c++: error: no such file); running the torch reference kernels"
    ]
    batch = make_batch(MIXED)
    out = kvkernels.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)
    torch.testing.assert_close(out, naive_attention(batch, 0.125), atol=2e-5, rtol=1e-4)
    with kvkernels.use_backend("cpu"), pytest.raises(kvkernels.CpuKernelsUnavailableError):
        kvkernels.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)


def test_the_build_directory_names_source_flags_torch_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_EXTENSIONS_DIR", str(tmp_path))
    first = cpu.build_directory()
    assert first.parent == tmp_path
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: "sse2")
    assert cpu.build_directory() != first


# The build and its race with a one-function source: what is under test is how processes
# that start together share the build folder, not the compiler's time on the kernels
# (every other test here loads the real ones).
BUILD_AND_CALL = """
import ctypes, sys
from pathlib import Path
from kvkernels import cpu
cpu.SOURCE = Path(sys.argv[1])
assert cpu.available()
assert ctypes.CDLL(str(cpu.build_directory() / cpu.LIBRARY)).kvtier_probe() == 42
"""


def test_processes_that_start_together_each_get_the_kernels(tmp_path):
    # Each builds in a folder of its own and renames it into place: no shared lock file
    # for a killed build to leave behind, and the loser of the rename keeps its own load.
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int kvtier_probe() { return 42; }\n')
    built_in = tmp_path / "extensions"
    env = {**os.environ, "KVTIER_EXTENSIONS_DIR": str(built_in)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_AND_CALL, str(source)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    built = list(built_in.iterdir())
    assert [d.name.startswith("kvtier_cpu_") and ".build-" not in d.name for d in built] == [True]
    assert (built[0] / cpu.LIBRARY).exists()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_copy_runs_copies_every_byte_of_runs_across_thread_pieces(backend):
    # Runs of uneven sizes, together over several 1 MiB pieces of parallel work, so that
    # pieces start and end inside runs.
    sizes = [3, 700_000, 1, 1_300_000, 524_288, 17]
    srcs = [torch.randint(-1000, 1000, (n,), dtype=torch.int16).to(torch.bfloat16) for n in sizes]
    dsts = [torch.zeros_like(s) for s in srcs]
    with kvkernels.use_backend(backend):
        kvkernels.copy_runs(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_copy_runs_refuses_runs_of_different_sizes():
    with pytest.raises(RuntimeError, match="equal sizes"):
        cpu.copy_runs([torch.zeros(4)], [torch.zeros(5)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [96, 100, 130], ids=["whole-words", "short-last-word", "past-the-mask"])
def test_token_bitmask_equals_the_reference(dtype, vocab):
    """Whole words allowed, refused and mixed (the sign bit too), rows out of order."""
    assert cpu.available()
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=generator)
    bitmask[0, 1], bitmask[1, 2], bitmask[2, 0] = 0, -1, -(2**31)
    rows = torch.tensor([5, 0, 3, 2])
    logits = torch.randn(6, vocab, generator=generator).to(dtype)
    expected, got = logits.clone(), logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    cpu.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without a mask are untouched
    assert torch.isinf(got[5, 32:64]).all() and not torch.isinf(got[0, 64:96]).any()  # words 0 and -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, cpu.SKINNY_ROWS])
@pytest.mark.parametrize(("outs", "ins"), [(96, 64), (1000, 37), (5, 1536)], ids=["even", "ragged-in", "few-out"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_skinny_linear_equals_the_fp64_product(dtype, rows, outs, ins, with_bias):
    """Every output of a few rows, over weights whose rows do not fill the kernel's lanes
    (37 inputs) and whose outputs split unevenly over the threads."""
    assert cpu.available()
    generator = torch.Generator().manual_seed(rows * outs + ins)
    x = torch.randn(rows, ins, generator=generator).to(dtype)
    weight = torch.randn(outs, ins, generator=generator).to(dtype)
    bias = torch.randn(outs, generator=generator).to(dtype) if with_bias else None
    expected = x.double() @ weight.double().t() + (bias.double() if with_bias else 0)
    got = cpu.skinny_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (rows, outs)
    tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    torch.testing.assert_close(got.double(), expected, **tolerance)


def test_linear_sends_only_few_fp32_rows_to_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "skinny_linear", lambda x, w, b: calls.append(x.shape[0]) or torch.zeros(x.shape[0], w.shape[0]))
    weight = torch.randn(8, 16)
    kvkernels.linear(torch.randn(cpu.SKINNY_ROWS, 16), weight)
    many = torch.randn(cpu.SKINNY_ROWS + 1, 16)
    torch.testing.assert_close(kvkernels.linear(many, weight), many @ weight.t())  # the BLAS path
    kvkernels.linear(torch.randn(1, 16).bfloat16(), weight.bfloat16())
    with kvkernels.use_backend("torch"):
        kvkernels.linear(torch.randn(1, 16), weight)
    assert calls == [cpu.SKINNY_ROWS]
