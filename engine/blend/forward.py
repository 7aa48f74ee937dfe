"""The blended prefill: a prompt region whose tokens mostly reuse KV computed elsewhere.

A region of a prompt (positions `plan.positions`, after `c` tokens of exact context
already in the cache) is computed layer by layer with the model's own modules. A token
with a stored KV (`reuse_slots >= 0`, the KV of its segment computed alone from
position 0) takes that KV, its key rotated by `reuse_shift` positions (RoPE rotations
compose: rotating a key computed at offset o by s gives the key at o + s). The others,
and the tokens selected for recompute, are computed in context.

Selection. Layer 0's KV depends only on the token and its position, so a moved key is
exact there; the first layer whose KV carries the missing cross-attention is layer 1
(the check layer). Layers 0 and 1 are therefore computed for every token of the
region; layers 2 and up compute only the tokens without stored KV and a fraction
`recompute_ratio` of the reusable ones: those the question attends to most. Before the
region, the question's tokens alone (the computed tokens after the last reused one) run
through every layer over the moved KV, and each reused token scores the largest
attention weight any of their heads pays it after the check layer; the tokens are ranked
by the largest score within `NEIGHBOURS` tokens of them in their segment (their own score
breaks ties), so that a token the question reads is recomputed with the words around it.
Moved KV errs most where the answer reads: a planted fact and the distractors like it
draw more attention from the question than they do in context, and recomputing them in
context restores that balance. CacheBlend's measure, the tokens whose values deviate most from their
stored ones at the check layer, recomputes what changed most whether or not the question
reads it; it remains for a region without question tokens. Why the choice, measured:
docs/ARCHITECTURE.md, "Blending". Ratio 1 computes everything: a full prefill.

Segment error. Moved KV errs in a common direction across its segment: the document was
computed without the context before it, and all its tokens lack the same thing. When the
budget allows, part of it recomputes a sample of each segment (every `SAMPLE_STRIDE`-th
token of the stored segment), and at each layer after the check layer every token that
keeps its moved KV gets its segment's mean error on that sample added: values as they
are, keys in the unrotated frame (a constant error there turns with the position after
RoPE).

Attention runs over the gathered context and region KV with a causal mask by absolute
position (recomputed tokens are scattered, which the paged kernels do not handle):
scaled_dot_product_attention in row tiles, each reading the keys its last row sees; the
question's scoring pass, which needs the weights, computes them explicitly in fp32. Every
layer's KV of the region, moved or fresh, is written to `dest_slots`, so that decoding
afterwards reads it from the paged cache like any other KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kvkernels
from engine.models import fused as fused_ops
from engine.models.rope import apply_rotary, inverse_frequencies

# The layer whose KV deviation picks the tokens to recompute (see the module docstring).
CHECK_LAYER = 1
# A reused token is worth what the question pays it or its neighbours within this many
# tokens of its segment: a fact is recomputed with the words around it.
NEIGHBOURS = 2
# One token in this many of a stored segment (by its offset there) is recomputed as a sample
# of the segment's error...
SAMPLE_STRIDE = 32
# ...when the recompute budget is at least this many times the sample: at lower ratios the
# rest of the blend is too far off for a mean error to help (docs/notes/architecture-history.md,
# "Blending").
SAMPLE_BUDGET_SHARE = 4
# About this many fp32 attention scores per tile of `_weighed_attention`.
_TILE_SCORES = 1 << 21
# Query rows per fused attention call (fewer rows see fewer keys; measured on CPU).
_FUSED_TILE_ROWS = 64


@dataclass(frozen=True)
class BlendPlan:
    """One blended prefill. Tensors are int64 on the cache's device except `positions`,
    which stays on the host too (`positions_cpu`) to cut attention tiles without a sync."""

    token_ids: torch.Tensor  # [n]
    positions_cpu: torch.Tensor  # [n], ascending, each >= len(context_slots)
    context_slots: torch.Tensor  # [c]: exact KV of positions 0 .. c-1, already in the cache
    dest_slots: torch.Tensor  # [n]: where the region's KV goes
    reuse_slots: torch.Tensor  # [n]: slot of the token's stored KV, -1 to compute it
    reuse_shift: torch.Tensor  # [n]: positions to move the stored key by
    recompute_ratio: float

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class BlendResult:
    """`hidden`: final-normed hidden states of region rows `rows` (those computed through
    every layer, in order); reused tokens kept their moved KV in layers after the check."""

    hidden: torch.Tensor
    rows: torch.Tensor
    num_reused: int
    num_recomputed: int


class ShiftRotary:
    """Rotations by a position offset: the model's rotary frequencies without the
    cos/sin scaling some rope types apply (a stored key already carries it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        args = model.args
        inv_freq, _scaling = inverse_frequencies(args.rope_parameters, args.head_dim)
        self.inv_freq = inv_freq.to(next(model.parameters()).device)

    def rotation(self, shift: torch.Tensor) -> Rotation:
        """The rotation of n keys by `shift [n]` positions, to apply at every layer."""
        angles = shift.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        return Rotation(angles.cos().unsqueeze(1), angles.sin().unsqueeze(1))

    def rotate(self, keys: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """`keys [n, heads, head_dim]` moved by `shift [n]` positions, computed in fp32."""
        return self.rotation(shift)(keys)


@dataclass(frozen=True)
class Rotation:
    """Per key, the cos and sin of its rotation, `[n, 1, head_dim // 2]` in fp32."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        """`keys [n, heads, head_dim]` rotated, computed in fp32, in their own dtype."""
        return apply_rotary(keys.float(), self.cos, self.sin).to(keys.dtype)


def blend_prefill(
    model: torch.nn.Module, kv_cache: torch.Tensor, plan: BlendPlan, shift_rotary: ShiftRotary
) -> BlendResult:
    """Compute `plan`'s region into `kv_cache` (see the module docstring)."""
    core = model.model
    device = kv_cache.device
    n = plan.num_tokens
    block_size = kv_cache.shape[3]
    reused = (plan.reuse_slots >= 0).nonzero().squeeze(1)
    computed = (plan.reuse_slots < 0).nonzero().squeeze(1)
    context = _split_slots(plan.context_slots, block_size)
    dest = plan.dest_slots
    shift = plan.reuse_shift[reused]  # one value per segment: what tells reused tokens' segments apart
    move = _Mover(shift_rotary, _split_slots(plan.reuse_slots[reused], block_size), shift)
    positions = plan.positions_cpu.to(device)
    cos, sin = core.rotary.cos_sin(positions)
    key_positions = torch.cat([torch.arange(len(plan.context_slots)), plan.positions_cpu])
    check_layer = min(CHECK_LAYER, len(core.layers) - 1)
    count = round(plan.recompute_ratio * len(reused))
    selective = 0 < count < len(reused)  # some reused tokens are recomputed, not all
    ranking = None  # reused rows, most worth recomputing first
    if selective:
        question = computed[computed > reused.max()]
        if len(question):
            attention = _question_attention(core, kv_cache, plan, reused, question, move, check_layer)
            ranking = _rank(_with_neighbours(attention, shift), attention)
    rows = torch.arange(n, device=device)
    rows_cpu = torch.arange(n)
    segment_error = None
    x = core.embed_tokens(plan.token_ids)
    for index, layer in enumerate(core.layers):
        kv_layer = kv_cache[:, index]
        attn = layer.self_attn
        fused = _fused(core, x)
        q, k, v = _project(attn, layer.input_layernorm(x, fused), cos[rows], sin[rows], fused)
        if index <= check_layer:  # every row is computed: fresh KV for the whole region
            k_region, v_region = k, v
            if index == check_layer:
                if ranking is None and selective:
                    deviation = _value_deviation(v[reused], _gather(kv_layer, move.sources, 1))
                    ranking = deviation.argsort(descending=True)
                reused_positions = positions[reused]
                sampled = _error_sample(reused_positions - shift, count) if selective else None
                rows = _select(reused, computed, count, ranking, sampled)
                if sampled is not None:
                    segment_error = _SegmentError(shift_rotary, reused, rows, sampled, reused_positions, shift)
                rows_cpu = rows.cpu()
                q, x = q[rows], x[rows]
        else:
            k_region = k.new_empty((n, *k.shape[1:]))
            v_region = v.new_empty((n, *v.shape[1:]))
            moved_k, moved_v = move(kv_layer)
            if segment_error is not None:
                segment_error.correct(k, v, moved_k, moved_v)
            k_region[reused], v_region[reused] = moved_k, moved_v
            k_region[rows], v_region[rows] = k, v
        kvkernels.write_kv(kv_layer, k_region, v_region, dest)
        keys = torch.cat([_gather(kv_layer, context, 0).to(k.dtype), k_region])
        values = torch.cat([_gather(kv_layer, context, 1).to(v.dtype), v_region])
        out = _masked_attention(q, keys, values, plan.positions_cpu[rows_cpu], key_positions, attn.scale)
        x = _after_attention(core, layer, x, out)
    return BlendResult(core.norm(x, _fused(core, x)), rows, num_reused=n - len(rows), num_recomputed=len(rows))


def _question_attention(
    core: torch.nn.Module, kv_cache: torch.Tensor, plan: BlendPlan, reused: torch.Tensor,
    question: torch.Tensor, move: _Mover, check_layer: int,
) -> torch.Tensor:
    """Per reused token, the largest attention weight any of the `question` rows pays it
    in any head of the layers after the check layer: the question's tokens alone run through
    every layer over the context and the moved KV of the reused tokens (the region's
    other computed tokens are not there yet, and are left out)."""
    block_size = kv_cache.shape[3]
    context = _split_slots(plan.context_slots, block_size)
    question_positions = plan.positions_cpu[question.cpu()]
    num_context = len(plan.context_slots)
    key_positions = torch.cat([torch.arange(num_context), plan.positions_cpu[reused.cpu()], question_positions])
    cos, sin = core.rotary.cos_sin(question_positions.to(kv_cache.device))
    attention = torch.zeros(len(key_positions), device=kv_cache.device)
    x = core.embed_tokens(plan.token_ids[question])
    for index, layer in enumerate(core.layers):
        kv_layer = kv_cache[:, index]
        attn = layer.self_attn
        fused = _fused(core, x)
        q, k, v = _project(attn, layer.input_layernorm(x, fused), cos, sin, fused)
        moved_k, moved_v = move(kv_layer)
        keys = torch.cat([_gather(kv_layer, context, 0).to(k.dtype), moved_k, k])
        values = torch.cat([_gather(kv_layer, context, 1).to(v.dtype), moved_v, v])
        if index > check_layer:
            out = _attention_noting_weights(q, keys, values, question_positions, key_positions, attn.scale, attention)
        else:
            out = _masked_attention(q, keys, values, question_positions, key_positions, attn.scale)
        x = _after_attention(core, layer, x, out)
    return attention[num_context : num_context + len(reused)]


def _after_attention(core: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer once its attention output `out` is known: the output
    projection and the MLP, each added to the residual stream `x`."""
    x = x + layer.self_attn.o_proj(out.flatten(1))
    fused = _fused(core, x)
    return x + layer.mlp(layer.post_attention_layernorm(x, fused), fused)


def _value_deviation(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """CacheBlend's measure: squared L2 distance of each token's fresh values from its
    stored ones."""
    return (fresh.float() - stored.float()).square().sum((1, 2))


def _with_neighbours(scores: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Each reused token's score raised to the largest of the tokens within `NEIGHBOURS`
    of it in the same segment (`segment`: one value per segment, its tokens adjacent)."""
    out = scores.clone()
    for d in range(1, NEIGHBOURS + 1):
        same = segment[d:] == segment[:-d]
        out[:-d] = torch.where(same, torch.maximum(out[:-d], scores[d:]), out[:-d])
        out[d:] = torch.where(same, torch.maximum(out[d:], scores[:-d]), out[d:])
    return out


def _rank(primary: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
    """Indices by descending `primary`, equal values by descending `tie_break`."""
    order = tie_break.argsort(descending=True, stable=True)
    return order[primary[order].argsort(descending=True, stable=True)]


def _error_sample(offsets: torch.Tensor, count: int) -> torch.Tensor | None:
    """Which reused tokens (by `offsets`, each one's offset in its stored segment) sample
    their segment's error, or None when `count` recomputed tokens cannot afford them."""
    sampled = offsets % SAMPLE_STRIDE == SAMPLE_STRIDE // 2
    size = int(sampled.sum())
    return sampled if size > 0 and SAMPLE_BUDGET_SHARE * size <= count else None


def _select(
    reused: torch.Tensor, computed: torch.Tensor, count: int, ranking: torch.Tensor | None,
    sampled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Region rows computed after the check layer: every token without stored KV, and
    `count` reusable tokens: the `sampled` ones (a mask over `reused`), then the first of
    `ranking` (indices into `reused`)."""
    if count == 0:
        return computed
    if count >= len(reused):
        return torch.cat([computed, reused]).sort().values
    if sampled is not None:
        ranking = torch.cat([sampled.nonzero().squeeze(1), ranking[~sampled[ranking]]])
    return torch.cat([computed, reused[ranking[:count]]]).sort().values


class _SegmentError:
    """Per layer, each segment's mean error of its moved KV, measured on its sampled tokens
    (computed in context at `rows`), added to its tokens that keep their moved KV. A
    segment without a sampled token is left as it is. Indices and rotations are worked out
    once, for every layer."""

    def __init__(
        self, rotary: ShiftRotary, reused: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor,
        positions: torch.Tensor, segment: torch.Tensor,
    ) -> None:
        kept = ~torch.isin(reused, rows)
        self.sampled = sampled.nonzero().squeeze(1)
        self.kept = kept.nonzero().squeeze(1)
        self.sample_rows = torch.searchsorted(rows, reused[self.sampled])
        _, segment_index = torch.unique(segment, return_inverse=True)
        self.num_segments = int(segment_index.max()) + 1
        self.sample_segment = segment_index[self.sampled]
        self.kept_segment = segment_index[self.kept]
        self.unrotate_sample = rotary.rotation(-positions[self.sampled])
        self.rotate_kept = rotary.rotation(positions[self.kept])
        sizes = torch.bincount(self.sample_segment, minlength=self.num_segments)
        self.inverse_sizes = (1 / sizes.clamp(min=1).float())[:, None, None]

    def correct(self, k: torch.Tensor, v: torch.Tensor, moved_k: torch.Tensor, moved_v: torch.Tensor) -> None:
        """Add the error to `moved_k`/`moved_v` (the reused tokens' moved KV, in place), from
        `k`/`v`, the layer's KV of the computed rows."""
        key_error = self.unrotate_sample(k[self.sample_rows].float() - moved_k[self.sampled].float())
        value_error = v[self.sample_rows].float() - moved_v[self.sampled].float()
        mean_key = self.rotate_kept(self._mean(key_error)[self.kept_segment])
        mean_value = self._mean(value_error)[self.kept_segment]
        moved_k.index_add_(0, self.kept, mean_key.to(moved_k.dtype))
        moved_v.index_add_(0, self.kept, mean_value.to(moved_v.dtype))

    def _mean(self, error: torch.Tensor) -> torch.Tensor:
        sums = error.new_zeros((self.num_segments, *error.shape[1:])).index_add_(0, self.sample_segment, error)
        return sums * self.inverse_sizes


class _Mover:
    """Reads the stored KV of the reused tokens from one layer and moves the keys."""

    def __init__(self, rotary: ShiftRotary, sources: tuple[torch.Tensor, torch.Tensor], shift: torch.Tensor) -> None:
        self.rotation = rotary.rotation(shift)
        self.sources = sources

    def __call__(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = _gather(kv_layer, self.sources, 0)
        return self.rotation(keys), _gather(kv_layer, self.sources, 1)


def _split_slots(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return slots // block_size, slots % block_size


def _gather(kv_layer: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], kv: int) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of the given slots, `[n, kv_heads, head_dim]`."""
    blocks, offsets = slots
    return kv_layer[blocks, kv, offsets]


def _fused(core: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether the elementwise chains over `x`'s rows run fused, as in the model's forward."""
    return core.fuse_large_steps and x.shape[0] >= fused_ops.MIN_FUSED_TOKENS


def _project(
    attn: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V of `h` through the layer's own projections, norms and rotary (their fused
    forms when `fused`, as in the model's forward)."""
    num_tokens, head_dim = h.shape[0], attn.head_dim
    q_size, kv_size = attn.num_heads * head_dim, attn.num_kv_heads * head_dim
    q, k, v = attn.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, attn.num_heads, head_dim)
    k = k.reshape(num_tokens, attn.num_kv_heads, head_dim)
    v = v.reshape(num_tokens, attn.num_kv_heads, head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q, fused), attn.k_norm(k, fused)
    rotate = fused_ops.rotary if fused else apply_rotary
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_positions: torch.Tensor, k_positions: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attention of `q [m, H, D]` over `k`/`v [L, KH, D]`, a query seeing the keys at
    positions up to its own (GQA by H // KH), fused: scaled_dot_product_attention with a
    mask by position. Positions are host tensors, keys in ascending position order, so
    each row tile reads only the keys its last row sees."""
    m = q.shape[0]
    keys = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KH, L, D]
    values = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
    visible_ends = torch.searchsorted(k_positions, q_positions, right=True).tolist()
    k_pos_dev, q_pos_dev = k_positions.to(q.device), q_positions.to(q.device)
    out = q.new_empty(q.shape)
    for first in range(0, m, _FUSED_TILE_ROWS):
        last = min(first + _FUSED_TILE_ROWS, m)
        visible = visible_ends[last - 1]
        mask = k_pos_dev[None, :visible] <= q_pos_dev[first:last, None]
        tile = F.scaled_dot_product_attention(
            q[first:last].transpose(0, 1).unsqueeze(0), keys[:, :, :visible], values[:, :, :visible],
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[first:last] = tile[0].transpose(0, 1)
    return out


def _attention_noting_weights(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_positions: torch.Tensor, k_positions: torch.Tensor, scale: float,
    key_attention: torch.Tensor,
) -> torch.Tensor:
    """`_masked_attention` with the attention weights computed explicitly (fp32 QK^T and
    softmax, in row tiles like the torch reference kernel); `key_attention [L]` is raised
    to each key's largest weight from any row and head."""
    m, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.view(m, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KH, G, m, D]
    kt = k.float().permute(1, 2, 0)  # [KH, D, L]
    vt = v.permute(1, 0, 2)  # [KH, L, D]
    out = q.new_empty((kv_heads, group, m, head_dim))
    tile = max(16, min(256, _TILE_SCORES // max(1, heads * k.shape[0])))
    visible_ends = torch.searchsorted(k_positions, q_positions, right=True).tolist()
    k_pos_dev = k_positions.to(q.device)
    for first in range(0, m, tile):
        last = min(first + tile, m)
        visible = visible_ends[last - 1]
        rows = last - first
        qt = qg[:, :, first:last].float().reshape(kv_heads, group * rows, head_dim)
        scores = torch.matmul(qt, kt[:, :, :visible]).mul_(scale).view(kv_heads, group, rows, visible)
        hidden = k_pos_dev[None, :visible] > q_positions[first:last].to(q.device)[:, None]
        scores.masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(-1)
        torch.maximum(key_attention[:visible], probs.amax((0, 1, 2)), out=key_attention[:visible])
        probs = probs.to(v.dtype).view(kv_heads, group * rows, visible)
        out[:, :, first:last] = torch.matmul(probs, vt[:, :visible]).view(kv_heads, group, rows, head_dim)
    return out.permute(2, 0, 1, 3).reshape(m, heads, head_dim)
