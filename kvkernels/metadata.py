"""Batch metadata that the attention and KV-write kernels read.

Tokens of one step are flattened: sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1]; its context holds seq_lens[i] tokens (the
cached ones plus the new ones), so the new tokens sit at positions
seq_lens[i] - query_len_i ... seq_lens[i] - 1 and attend causally to everything before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the cache's device
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    query_lens_cpu: list[int]  # host copies, so the torch path never syncs
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # What a kernel derives from this metadata once per step and every layer reuses
    # (index tensors, masks), keyed by the kernel; built on first use.
    derived: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def one_prefill(cls, length: int, block_size: int) -> AttentionMetadata:
        """One sequence of `length` new tokens, nothing cached, in blocks 0, 1, ... of a
        cache of `block_size`-token blocks (on CPU)."""
        blocks = -(-length // block_size)
        return cls(
            query_start_loc=torch.tensor([0, length], dtype=torch.int32),
            seq_lens=torch.tensor([length], dtype=torch.int32),
            block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            slot_mapping=torch.arange(length),
            query_lens_cpu=[length], seq_lens_cpu=[length], max_query_len=length, max_seq_len=length,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))
