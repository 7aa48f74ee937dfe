"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Module names mirror the Hugging Face checkpoints (`model.layers.N.self_attn...`), except
that q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj`, whose `shards` name
the checkpoint projections they hold (see `loader.checkpoint_targets`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

import kvkernels
from engine.models import fused as fused_ops
from engine.models.args import ModelArgs
from engine.models.layers import Embedding, Linear, RMSNorm, pack_weight, packed_linear
from engine.models.rope import RotaryEmbedding, apply_rotary
from kvkernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward pass shares: the rotary cos/sin of the tokens'
    positions, the attention metadata of the batch, and whether its elementwise chains
    run fused (engine/models/fused.py)."""

    cos: torch.Tensor
    sin: torch.Tensor
    meta: AttentionMetadata
    fused: bool = False


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        self.qk_size = args.q_size + args.kv_size
        self.scale = args.head_dim**-0.5
        qkv = {"q_proj": args.q_size, "k_proj": args.kv_size, "v_proj": args.kv_size}
        self.qkv_proj = Linear(args.hidden_size, qkv, args.qkv_bias, dtype, device)
        self.o_proj = Linear(args.q_size, {"o_proj": args.hidden_size}, args.o_bias, dtype, device)
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, step: StepInputs) -> torch.Tensor:
        num_tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        # Q and K heads side by side, so that one rotary call covers both.
        qk = qkv[:, : self.qk_size].view(num_tokens, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads], step.fused), self.k_norm(qk[:, heads:], step.fused)), dim=1)
        qk = (fused_ops.rotary if step.fused else apply_rotary)(qk, step.cos, step.sin)
        q, k = qk[:, :heads], qk[:, heads:]
        kvkernels.write_kv(kv_layer, k, v, step.meta.slot_mapping)
        out = kvkernels.paged_attention(q, kv_layer, step.meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size = args.intermediate_size
        gate_up = {"gate_proj": size, "up_proj": size}
        self.gate_up_proj = Linear(args.hidden_size, gate_up, args.mlp_bias, dtype, device)
        self.down_proj = Linear(size, {"down_proj": args.hidden_size}, args.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        silu_and_mul = fused_ops.silu_and_mul if fused else fused_ops.eager_silu_and_mul
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.self_attn = Attention(args, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.mlp = MLP(args, dtype, device)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, step: StepInputs) -> torch.Tensor:
        # In place: the residual stream is this forward's own tensor (the embedding output).
        x = x.add_(self.self_attn(self.input_layernorm(x, step.fused), kv_layer, step))
        return x.add_(self.mlp(self.post_attention_layernorm(x, step.fused), step.fused))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(args, dtype, device) for _ in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings, dtype, device
        )
        self.fuse_large_steps = False  # set by CausalLM.fuse_large_steps

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        fused = self.fuse_large_steps and x.shape[0] >= fused_ops.MIN_FUSED_TOKENS
        step = StepInputs(*self.rotary.cos_sin(positions), meta, fused)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_cache[:, i], step)
        return self.norm(x, fused)


class CausalLM(nn.Module):
    """`model(input_ids[T], positions[T], kv_cache, meta) -> hidden [T, hidden_size]`."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args, dtype, device)
        self.lm_head = None
        if not args.tie_word_embeddings:
            self.lm_head = Linear(
                args.hidden_size, {"lm_head": args.vocab_size}, False, dtype, device
            )
        self.packed_logits_weight: torch.Tensor | None = None  # a tied head's, once packed

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache, meta)

    def fuse_large_steps(self) -> None:
        """Run the elementwise chains of steps of MIN_FUSED_TOKENS or more fused (CPU only:
        on CUDA the compiled kernels would be Triton ones, not tested here); compiles them
        now, in one forward of a large step into a scratch cache, so that each compiled
        form meets the very inputs of a real step (parameters, strided views of the QKV
        projection, eps) and the first large request compiles nothing."""
        weight = next(self.parameters())
        if weight.device.type != "cpu":
            return
        self.model.fuse_large_steps = True
        # One more than the threshold: a token count equal to a model dimension (256 is
        # common) would make dynamo tie the two sizes together and compile again later.
        tokens, block_size = fused_ops.MIN_FUSED_TOKENS + 1, 16
        blocks = -(-tokens // block_size)
        args = self.args
        kv_cache = torch.zeros(blocks, args.num_layers, 2, block_size, args.num_kv_heads, args.head_dim,
                               dtype=weight.dtype)
        meta = AttentionMetadata.one_prefill(tokens, block_size)
        with torch.inference_mode():
            self(torch.zeros(tokens, dtype=torch.long), torch.arange(tokens), kv_cache, meta)

    def pack_weights(self) -> bool:
        """Pack every projection's weight for CPU matmuls (layers.pack_weight) once the
        checkpoint is loaded; a tied head gets a packed copy of the embedding, which the
        embedding lookup still reads. Whether anything was packed."""
        try:
            packed = [m.pack() for m in self.modules() if isinstance(m, Linear)]
            if self.lm_head is None:
                self.packed_logits_weight = pack_weight(self.model.embed_tokens.weight)
        except RuntimeError as exc:  # what is packed so far stays packed; the rest runs plain
            log.warning("packing the weights for oneDNN failed (%s); plain matmuls for the rest", exc)
            return False
        return any(packed)

    def weight_bytes(self) -> int:
        """Bytes of the weights one forward reads, packed or not (a tied head once)."""
        packed = [m.packed for m in self.modules() if isinstance(m, Linear) and m.packed is not None]
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *packed])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[n, vocab]` of the rows of `hidden` that are sampled."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_logits_weight is not None:
            return packed_linear(hidden, self.packed_logits_weight, None).float()
        return kvkernels.linear(hidden, self.model.embed_tokens.weight).float()
