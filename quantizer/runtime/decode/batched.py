"""Several sequences decoded together: one native call a step advances every sequence by a token.

A :class:`BatchedDecoder` holds one KV cache per sequence in one tensor a layer and one
``DecodePlan`` over them (``csrc/decode_plan.cpp``, its ``rows`` call), so a step multiplies every
sequence's token by each weight in one pass of the int8 kernels, and each sequence's attention reads
its own cache. Prompts may differ in length. Each sequence's final hidden states are, bit for bit,
those of a :class:`.decoder.FastDecoder` with its native step decoding that sequence alone: the int8
kernels' rows are independent, each row attends over its own sequence, and prompts take the same
path (the plan where the single-sequence step takes them, else the eager prefill). So are its logits
where the head is int4q's (its GEMV sums each row as alone); a bf16 head multiplies several rows
through PyTorch's GEMM, which may round them otherwise. Covers the models the native step covers,
and refuses the others.
"""

from __future__ import annotations

import torch

from ...errors import InputError
from .decoder import FastDecoder
from .native_step import make_plan, native_step


class BatchedDecoder:
    """``sequences`` sequences of up to ``max_len`` tokens each over ``model`` (a cpu_int4 model whose
    decode is int8, see :mod:`..activations`): :meth:`prefill` their prompts, then :meth:`step`.
    InputError where the model has no native step or the arguments do not fit."""

    def __init__(self, model: torch.nn.Module, sequences: int, max_len: int):
        if sequences < 1:
            raise InputError(f"a batch needs at least one sequence, not {sequences}")
        decoder = FastDecoder(model, max_len, sequences)
        self._caches = decoder.keys, decoder.values
        self._point_at(decoder, 0)
        single = native_step(decoder)
        if single is None:
            raise InputError("batched decoding needs int4q's native decode step, which this model or CPU does "
                             "not have (see the log); decode the sequences one at a time")
        self.decoder, self.rows = decoder, single.rows
        self.plan = make_plan(single.spec, decoder.cos, decoder.sin, [list(kv) for kv in zip(*self._caches)])
        self.embed, self.head = decoder.embed, decoder.head
        self.sequences, self.max_len = sequences, max_len
        self.positions = torch.zeros(sequences, dtype=torch.long)

    def _point_at(self, decoder: FastDecoder, sequence: int) -> None:
        """Make ``decoder``'s caches (one sequence's) the views of ``sequence`` in the shared caches."""
        keys, values = self._caches
        decoder.keys = [k[sequence : sequence + 1] for k in keys]
        decoder.values = [v[sequence : sequence + 1] for v in values]

    @torch.inference_mode()
    def prefill(self, prompts: list[torch.Tensor]) -> torch.Tensor:
        """Start every sequence over: ``prompts``, one 1-D tensor of token ids each (lengths may differ)
        -> logits [sequences, V] after each prompt's last token."""
        if len(prompts) != self.sequences:
            raise InputError(f"{len(prompts)} prompts for a batch of {self.sequences} sequences")
        lengths = [int(p.numel()) for p in prompts]
        if min(lengths) < 1 or max(lengths) > self.max_len:
            raise InputError(f"prompts must hold 1 to {self.max_len} tokens, not {min(lengths)}..{max(lengths)}")
        self.positions = torch.tensor(lengths)
        short = [s for s, n in enumerate(lengths) if n <= self.rows]
        logits = [None] * self.sequences
        for s in (s for s in range(self.sequences) if s not in short):
            self._point_at(self.decoder, s)
            self.decoder.reset()
            logits[s] = self.decoder.eager_forward(prompts[s].view(1, -1))
        self._point_at(self.decoder, 0)
        for s, row in zip(short, self._plan_rows([prompts[s].view(-1) for s in short], short)):
            logits[s] = row
        return torch.cat(logits)

    def _plan_rows(self, prompts: list[torch.Tensor], sequences: list[int]) -> list[torch.Tensor]:
        """Logits [1, V] after each of ``prompts`` (of ``sequences``), their tokens packed into plan calls
        of up to :attr:`rows` rows."""
        if not prompts:
            return []
        ids = torch.cat(prompts)
        owner = torch.cat([torch.full((p.numel(),), s) for p, s in zip(prompts, sequences)])
        position = torch.cat([torch.arange(p.numel()) for p in prompts])
        last = torch.cumsum(torch.tensor([p.numel() for p in prompts]), 0) - 1
        normed = torch.cat([self.plan.rows(self.embed(ids[i : i + self.rows]).to(torch.bfloat16),
                                           owner[i : i + self.rows], position[i : i + self.rows])
                            for i in range(0, ids.numel(), self.rows)])
        return list(self.head(normed[last, None])[:, 0].split(1))

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` [sequences] (one id each) -> logits [sequences, V] after them."""
        if tokens.shape != (self.sequences,):
            raise InputError(f"a step takes one token for each of {self.sequences} sequences, "
                             f"got {tuple(tokens.shape)}")
        if int(self.positions.max()) >= self.max_len:
            raise InputError(f"a sequence would exceed this batch's cache of {self.max_len} tokens")
        h = self.embed(tokens.view(-1, 1)).to(torch.bfloat16).view(self.sequences, -1)
        normed = self.plan.rows(h, torch.arange(self.sequences), self.positions)
        self.positions = self.positions + 1
        return self.head(normed[:, None])[:, 0]
