"""Which activations the int4 linears multiply: ``exact`` (bf16, the GEMV and the dequantized
prefill) or ``int8`` (rounded per weight group, :mod:`.native.w4a8`), chosen separately for decode
(fewer rows than ``dequant_threshold``) and prefill. The defaults are int8 for both (docs/runtime.md, "Int8 activations"); int8 applies where the CPU has AVX-512 VNNI (both phases) or, for
decode, AVX2 (:mod:`.native.w4a8_rows`); elsewhere those rows take the exact paths. An int8
decode also computes the fast decoder's single-token attention in fp32
(:func:`.decode.decoder.attend_in_fp32`); exact decode keeps transformers' bf16 attention.

The choice is a process setting carried in ``INT4Q_ACTIVATIONS`` (e.g. ``decode=int8,prefill=exact``),
so the background compile worker a run starts builds the same step; :func:`choose` sets it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError

ENV = "INT4Q_ACTIVATIONS"
CHOICES = ("exact", "int8")

KV_CACHES = ("bf16", "int8")
"""What the fast decoder's cache of keys and values (the attention's activations) holds: bf16 rows,
or int8 codes with their scales (:mod:`.kernels.kv_int8`; chosen per decoder, not per process)."""


@dataclass(frozen=True)
class Activations:
    """The activation precision of decode and of prefill, each one of :data:`CHOICES`."""

    decode: str = "int8"
    prefill: str = "int8"

    def __post_init__(self):
        for phase in ("decode", "prefill"):
            if getattr(self, phase) not in CHOICES:
                raise ValueError(f"{phase} activations must be one of {', '.join(CHOICES)}, "
                                 f"not {getattr(self, phase)!r}")

    def encode(self) -> str:
        return f"decode={self.decode},prefill={self.prefill}"

    @classmethod
    def parse(cls, text: str) -> "Activations":
        """From :meth:`encode`'s form (either phase may be left out); UsageError names what is wrong."""
        fields = dict(part.strip().partition("=")[::2] for part in text.split(",") if part.strip())
        try:
            unknown = sorted(set(fields) - {"decode", "prefill"})
            if unknown:
                raise ValueError(f"unknown phase {unknown[0]!r}")
            return cls(**fields)
        except ValueError as e:
            raise UsageError(f"{ENV}={text!r}: {e}; set it as decode=int8|exact,prefill=int8|exact, or unset it") \
                from None


EXACT = Activations("exact", "exact")
"""Both phases exact."""


def current() -> Activations:
    """The process's setting: ``INT4Q_ACTIVATIONS`` where set, else the defaults."""
    text = os.environ.get(ENV)
    return Activations.parse(text) if text else Activations()


def chosen_explicitly() -> bool:
    """Whether the setting comes from the user (``INT4Q_ACTIVATIONS``, the CLI options), not the defaults."""
    return bool(os.environ.get(ENV))


def choose(decode: str | None = None, prefill: str | None = None) -> Activations:
    """Set the process's choice (None keeps a phase as it is; with neither, nothing is set) and return it."""
    now = current()
    if decode is None and prefill is None:
        return now
    chosen = Activations(decode or now.decode, prefill or now.prefill)
    os.environ[ENV] = chosen.encode()
    return chosen
