"""Torch implementations of the kernel contracts: what the CPU engine runs, and the
oracle the Triton kernels are tested against.

Attention runs on SDPA's fused kernels (on CPU the flash kernel: tiled, fp32
accumulation, bf16 matmuls on AMX where the CPU has it). A sequence with several new
tokens (a prefill chunk) is computed on its own: its chunk attends causally to itself
and fully to the context before it, two flash calls whose partial results are merged by
their log-sum-exp (SDPA's causal mask is top-left aligned, and an explicit bottom-right
mask would make it compute the masked triangle too). All single-token decodes of a step
share one padded SDPA call, so a 32-request decode step is one call, not 32. Host-side
lengths (`meta.*_cpu`) drive the loops, so nothing here syncs a device. The padded call
reads slots past a sequence's length (stale KV of freed blocks); `write_kv` stores only
finite values into the zero-initialised cache (and the engine zeroes what a forward that
raised left behind), so the length mask alone keeps them out of every output, as the
Triton kernel's masked loads do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvkernels.metadata import AttentionMetadata


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value `[num_tokens, kv_heads, head_dim]` at their slots; slot < 0 is skipped.

    NaN and inf are stored as 0: `_decode_batch` reads slots past each sequence's end
    (stale KV of a block's earlier owner) and relies on every slot of the
    zero-initialised cache being finite, since a NaN or inf there would survive the
    length mask. A request whose own KV overflows is wrong either way; this keeps it from
    spoiling the requests that later reuse its blocks (zeroing the padding per step
    instead costs more than the attention itself)."""
    block_size = kv_layer.shape[2]
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv = torch.stack((key, value), dim=1).to(kv_layer.dtype)  # [T, 2, KH, D]: one write
    kv_layer[blocks, :, offsets] = kv.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal varlen attention over the paged cache; returns `[num_tokens, heads, head_dim]`."""
    plan = _step_plan(meta, kv_layer.shape[2], query.device)
    out = query.new_empty(query.shape)
    if plan.decodes is not None:
        _decode_batch(query, kv_layer, plan.decodes, scale, out)
    _prefills(query, kv_layer, plan, scale, out)
    return out


def prefill_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor,
) -> None:
    """The rows of the sequences with several new tokens (prefill chunks) of
    `paged_attention`, written into `out`; the other rows are left as they are."""
    _prefills(query, kv_layer, _step_plan(meta, kv_layer.shape[2], query.device), scale, out)


def _prefills(
    query: torch.Tensor, kv_layer: torch.Tensor, plan: _StepPlan, scale: float, out: torch.Tensor
) -> None:
    for rows, ctx_len, block_ids in plan.prefills:
        k, v = _gather_context(kv_layer, block_ids, ctx_len)
        causal_attention(query[rows], k, v, scale, out[rows])


@dataclass(frozen=True)
class _Decodes:
    """The single-token sequences of a step, as one padded batch."""

    rows: slice | torch.Tensor  # their query rows
    block_ids: torch.Tensor  # [S, blocks of the longest]
    max_len: int
    mask: torch.Tensor | None  # [S, 1, 1, max_len], None when all lengths are equal


@dataclass(frozen=True)
class _StepPlan:
    """What every layer's attention call of one step shares, derived once from the metadata."""

    decodes: _Decodes | None
    prefills: list[tuple[slice, int, torch.Tensor]]  # (query rows, context length, block ids)


def _step_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
    key = f"reference/{block_size}"
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _make_plan(meta, block_size, device)
    return plan


def _make_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
    starts = _prefix_sums(meta.query_lens_cpu)
    seqs = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    decodes = None
    if seqs:
        lens = [meta.seq_lens_cpu[i] for i in seqs]
        max_len = max(lens)
        mask = None
        if min(lens) < max_len:
            # Past each sequence's end the gathered slots hold stale but finite KV (see
            # write_kv), so the length mask alone keeps them out.
            lengths = torch.tensor(lens, device=device)
            mask = (torch.arange(max_len, device=device) < lengths[:, None])[:, None, None, :]
        tables = meta.block_tables[_as_index(seqs, device), : -(-max_len // block_size)]
        decodes = _Decodes(_as_index([starts[i] for i in seqs], device), tables, max_len, mask)
    prefills = []
    for i, q_len in enumerate(meta.query_lens_cpu):
        if q_len > 1:
            ctx_len = meta.seq_lens_cpu[i]
            block_ids = meta.block_tables[i, : -(-ctx_len // block_size)]
            prefills.append((slice(starts[i], starts[i] + q_len), ctx_len, block_ids))
    return _StepPlan(decodes, prefills)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, exactly like transformers
    (F.rms_norm in fp32 is bit-identical to its pow/mean/rsqrt, in one call)."""
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype).mul_(weight)


def copy_runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dsts[i].copy_(srcs[i])` for each pair of contiguous tensors of equal sizes."""
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set `logits[rows[i], t]` to -inf where bit t of `bitmask[i]` (int32 words, bit t of
    word t // 32 is token t) is clear, and for tokens past the bitmask's width."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy blocks `block_ids` of the block-major cache into `out` (record layout)."""
    torch.index_select(kv_cache, 0, block_ids, out=out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (record layout) into blocks `block_ids` of the block-major cache."""
    kv_cache.index_copy_(0, block_ids, src.to(kv_cache.dtype))


def _prefix_sums(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _gather_context(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of blocks `block_ids` (`[..., nb]`) as `[..., kv_heads, length, head_dim]` views.

    K and V are gathered separately so that the block and slot dims stay mergeable and
    the result needs no second copy."""
    shape = (*block_ids.shape[:-1], -1, *kv_layer.shape[3:])  # [..., nb * B, KH, D]
    flat_ids = block_ids.reshape(-1)
    k = kv_layer[:, 0].index_select(0, flat_ids).view(shape)[..., :length, :, :]
    v = kv_layer[:, 1].index_select(0, flat_ids).view(shape)[..., :length, :, :]
    return k.transpose(-2, -3), v.transpose(-2, -3)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """Bottom-right causal attention of `q` `[Lq, H, D]` over `k`/`v` `[KH, L, D]` into
    `out` `[Lq, H, D]`: query row r sees keys `0 .. L - Lq + r`.

    The query heads that share a KV head are SDPA's heads and the KV heads its batch, with
    K and V broadcast over the group (a stride-0 view, no copy)."""
    q_len, heads, head_dim = q.shape
    kv_heads, ctx_len = k.shape[0], k.shape[1]
    group = heads // kv_heads
    past = ctx_len - q_len
    qg = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kg = k.to(q.dtype)[:, None].expand(kv_heads, group, ctx_len, head_dim)
    vg = v.to(q.dtype)[:, None].expand(kv_heads, group, ctx_len, head_dim)
    out_heads = out.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # qg's layout
    if q.device.type == "cpu":
        res, lse = _flash(qg, kg[:, :, past:], vg[:, :, past:], True, scale)
        if past:
            res_past, lse_past = _flash(qg, kg[:, :, :past], vg[:, :, :past], False, scale)
            _merge_into(out_heads, res, lse, res_past, lse_past)
            return
    else:
        allowed = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device).tril_(past)
        res = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=allowed, scale=scale)
    out_heads.copy_(res)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel, with the log-sum-exp of each row's scores (fp32)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def _merge_into(
    out: torch.Tensor, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """Attention over the union of two key sets, from the attention over each and their
    log-sum-exps, written into `out`: each part weighted by its share of the softmax mass,
    `b + (a - b) * share_a` in one pass (lerp computes in fp32 for bf16 inputs)."""
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1).to(a.dtype)
    torch.lerp(b, a, share_a, out=out)


def _decode_batch(
    query: torch.Tensor, kv_layer: torch.Tensor, decodes: _Decodes, scale: float,
    out: torch.Tensor,
) -> None:
    """All single-token sequences in one padded SDPA call.

    The query heads sharing a KV head are folded into SDPA's query-length dim
    (`[S, KH, group, D]`); that is ~10x faster on CPU than `enable_gqa` with 1 row."""
    k, v = _gather_context(kv_layer, decodes.block_ids, decodes.max_len)  # [S, KH, L, D]
    num_seqs, kv_heads, _, head_dim = k.shape
    q = query[decodes.rows].view(num_seqs, kv_heads, -1, head_dim)
    res = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=decodes.mask, scale=scale
    )
    out[decodes.rows] = res.reshape(num_seqs, -1, head_dim)


def _as_index(positions: list[int], device: torch.device) -> slice | torch.Tensor:
    """`positions` as a slice when they are consecutive (the common case: the decodes come
    first in a step), else as an index tensor."""
    first = positions[0]
    if positions[-1] - first == len(positions) - 1:
        return slice(first, first + len(positions))
    return torch.tensor(positions, device=device)
