"""The per-step batch the runner builds once and every layer reads.

A batch is a list of sequences. Each sequence has `prefix_len` tokens whose
K/V already sit in the pool and `extend_len` new tokens (a decode is an extend
of 1; a plain prefill has prefix 0). Its `kv_slots` list the pool slots of all
`prefix_len + extend_len` tokens in order; the last `extend_len` of them
receive the new tokens' K/V.

    sequence i:  kv_slots[i] = [ s0 s1 ... s(p-1) | n0 n1 ... n(e-1) ]
                                 prefix (cached)     new: written this step
    new tokens of all sequences, concatenated:  input_ids / positions / out_slots
    qo_offsets[i] .. qo_offsets[i+1]  = rows of sequence i in the new tokens
    kv_offsets[i] .. kv_offsets[i+1]  = its slots in kv_indices

It is passed explicitly to the model and the attention backend; there is no
global "current batch".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_slots: torch.Tensor  # [num_tokens] int64, pool slot of each new token
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64, slots of every sequence, concatenated
    # [num_seqs + 1] each: where each sequence's new-token rows and slots start, as Python ints
    # (index arithmetic without a torch call: each costs microseconds, more with the caches cold
    # after a step; the GPU backends build their own device tensors from them)
    qo_offsets: tuple[int, ...]
    kv_offsets: tuple[int, ...]
    last_token_rows: torch.Tensor  # [num_seqs] int64, row of each sequence's last new token

    @classmethod
    def build(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        kv_slots: Sequence[torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Assemble a batch from per-sequence new tokens, prefix lengths and slot lists."""
        if not (len(new_token_ids) == len(prefix_lens) == len(kv_slots)) or not new_token_ids:
            raise ValueError("new_token_ids, prefix_lens and kv_slots need one entry per sequence")
        extend_lens = tuple(len(ids) for ids in new_token_ids)
        prefix_lens = tuple(int(p) for p in prefix_lens)
        for i, (p, e, slots) in enumerate(zip(prefix_lens, extend_lens, kv_slots)):
            if e < 1:
                raise ValueError(f"sequence {i} has no new tokens")
            if slots.numel() != p + e:
                raise ValueError(
                    f"sequence {i}: kv_slots has {slots.numel()} entries, expected prefix {p} + new {e}"
                )
        # the ids, positions and last rows from Python ints in one tensor, sliced into views: a
        # batch is built at every step, and each torch op here costs several microseconds
        qo_offsets = (0, *itertools.accumulate(extend_lens))
        flat_ids = [t for ids in new_token_ids for t in ids]
        positions = [q for p, e in zip(prefix_lens, extend_lens) for q in range(p, p + e)]
        numbers = torch.tensor(flat_ids + positions + [end - 1 for end in qo_offsets[1:]], dtype=torch.int64)
        num_tokens = len(flat_ids)
        ids_t, positions_t = numbers[:num_tokens], numbers[num_tokens : 2 * num_tokens]
        last_rows = numbers[2 * num_tokens :]
        slots_cpu = [s.to(torch.int64).cpu() for s in kv_slots]
        kv_indices = torch.cat(slots_cpu)
        out_slots = torch.cat([s[p:] for p, s in zip(prefix_lens, slots_cpu)])
        return cls(
            input_ids=ids_t.to(device),
            positions=positions_t.to(device),
            out_slots=out_slots.to(device),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            kv_indices=kv_indices.to(device),
            qo_offsets=qo_offsets,
            kv_offsets=(0, *itertools.accumulate(p + e for p, e in zip(prefix_lens, extend_lens))),
            last_token_rows=last_rows.to(device),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens))

    @property
    def is_decode_only(self) -> bool:
        return all(e == 1 for e in self.extend_lens)

    def decode_and_extend_ids(self) -> tuple[list[int], list[int]]:
        """Indices of the decode sequences (one new token) and of the extend ones (more).

        The GPU backends send the two kinds to different kernels, so each
        plans them apart.
        """
        decode_ids = [i for i, e in enumerate(self.extend_lens) if e == 1]
        extend_ids = [i for i, e in enumerate(self.extend_lens) if e > 1]
        return decode_ids, extend_ids

    def token_rows(self, seq_ids: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows of the new tokens (of q) that belong to the sequences `seq_ids`, in that order."""
        starts = self.qo_offsets
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seq_ids])
        return rows.to(device, non_blocking=True)

