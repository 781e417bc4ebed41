"""How one module is stored: the per-module scheme that the planner decides, the format writes,
and verify and the runtime read back from ``quantization_config``."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedError

GROUP_SIZES = (32, 64, 128, 256)
KEPT_BITS = 16
BITS = (4, 8, KEPT_BITS)


@dataclass(frozen=True)
class ModuleScheme:
    """One module's grid.

    ``bits`` 4: group-wise asymmetric or symmetric codes, ``group_size`` input columns per scale
    and zero; 8: symmetric per output channel (no groups); 16: kept in the checkpoint's float dtype.
    """

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise UnsupportedError(f"bits {self.bits} is not one of {', '.join(map(str, BITS))}")
        if self.bits == 4 and self.group_size not in GROUP_SIZES:
            raise UnsupportedError(f"group_size {self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
        if self.bits != 4 and self.group_size is not None:
            raise UnsupportedError(f"group_size is for 4-bit modules; a {self.bits}-bit one has none")

    @property
    def kept(self) -> bool:
        return self.bits == KEPT_BITS

    def to_dict(self) -> dict:
        """The override entry of ``quantization_config.modules``."""
        d: dict = {"bits": self.bits}
        if self.bits == 4:
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
        group = d.get("group_size", default.group_size if bits == 4 else None)
        return cls(bits, group, bool(d.get("symmetric", default.symmetric)) if bits != KEPT_BITS else False)
