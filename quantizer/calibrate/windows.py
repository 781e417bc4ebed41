"""Calibration text -> token windows, seeded and reproducible."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class CalibrationSettings:
    """How calibration text becomes windows, and the precision the layers run them in, for every
    calibrated method."""

    nsamples: int | None = None  # windows; None: the method's default
    seqlen: int = 512  # tokens per window
    seed: int = 0  # for their offsets
    precision: str = "bf16"  # of the layers' weights and activations: bf16, as the model runs, or fp32

    def resolved(self, default_nsamples: int) -> "CalibrationSettings":
        """These settings with ``nsamples`` decided."""
        return self if self.nsamples is not None else dataclasses.replace(self, nsamples=default_nsamples)

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]


PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def calibration_windows(tokenizer, text: str, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """[nsamples, seqlen] int64 token ids: windows at seeded random offsets of the tokenised text.

    Windows may overlap when the text holds fewer than nsamples * seqlen tokens; a text shorter
    than one window is an error.
    """
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if len(ids) < seqlen + 1:
        raise InputError(f"the calibration text has {len(ids)} tokens; at least {seqlen + 1} are needed for "
                         f"--seqlen {seqlen} (give more text or a smaller --seqlen)")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (nsamples,), generator=gen)
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])
