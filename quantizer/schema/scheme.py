"""How one module is stored: the per-module scheme that the planner decides, the format writes,
and verify and the runtime read back from ``quantization_config``."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedError

GROUP_SIZES = (32, 64, 128, 256)
KEPT_BITS = 16
BITS = (4, 5, 6, 8, KEPT_BITS)
GROUPS_OF = {4: GROUP_SIZES, 5: (32,), 6: (16,)}
"""The group-wise precisions and their group sizes: 4 bits (every format), and GGUF's 5 bits
(Q5_0, Q5_1, Q5_K: groups of 32) and 6 bits (Q6_K: groups of 16, symmetric)."""


def more_bits_layer(i: int, n: int) -> bool:
    """The layers of n that llama.cpp's Q4_K_M gives more bits: the first and last eighth, and
    every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class ModuleScheme:
    """One module's grid.

    ``bits`` 4, 5 or 6: group-wise asymmetric or symmetric codes, ``group_size`` input columns per
    scale and zero (6 bits: symmetric only); 8: symmetric per output channel (no groups); 16: kept
    in the checkpoint's float dtype.
    """

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise UnsupportedError(f"bits {self.bits} is not one of {', '.join(map(str, BITS))}")
        if self.grouped and self.group_size not in GROUPS_OF[self.bits]:
            raise UnsupportedError(f"group_size {self.group_size} is not one of "
                                   f"{', '.join(map(str, GROUPS_OF[self.bits]))} for {self.bits} bits")
        if not self.grouped and self.group_size is not None:
            raise UnsupportedError(f"group_size is for group-wise modules; a {self.bits}-bit one has none")
        if self.bits == 6 and not self.symmetric:
            raise UnsupportedError("6-bit modules (GGUF's Q6_K) are symmetric")

    @property
    def grouped(self) -> bool:
        """Whether the codes are group-wise (4, 5 or 6 bits), not per channel or kept."""
        return self.bits in GROUPS_OF

    @property
    def kept(self) -> bool:
        return self.bits == KEPT_BITS

    def to_dict(self) -> dict:
        """The override entry of ``quantization_config.modules``."""
        d: dict = {"bits": self.bits}
        if self.grouped:
            d["group_size"] = self.group_size
        if self.bits != KEPT_BITS:
            d["symmetric"] = self.symmetric
        return d

    @classmethod
    def from_dict(cls, d: dict, default: "ModuleScheme") -> "ModuleScheme":
        """An override entry; keys it leaves out take the checkpoint-wide ``default``."""
        if not isinstance(d, dict) or set(d) - {"bits", "group_size", "symmetric"}:
            raise UnsupportedError(f"a quantization_config.modules entry must hold bits, group_size and "
                                   f"symmetric only, got {d!r}")
        bits = d.get("bits", default.bits)
        group = d.get("group_size", default.group_size if bits == 4 else GROUPS_OF.get(bits, (None,))[0])
        if bits == KEPT_BITS:
            return cls(bits)
        return cls(bits, group, bits == 6 or bool(d.get("symmetric", default.symmetric)))
