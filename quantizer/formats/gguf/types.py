"""The file types of ``--gguf-type`` and the block type each gives a module, as llama-quantize
chooses them (llama.cpp's ``llama-quant.cpp``): the precision of the run's default modules, the
K-quant mixtures' extra bits for some tensors, found by their GGUF names, and the type a row that
256-weight super-blocks do not divide falls back to. Pure functions of names and shapes; no torch,
so the CLI lists the names cheaply."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...schema.scheme import GROUPS_OF, KEPT_BITS, ModuleScheme, more_bits_layer

BLOCK = 32  # weights per block of the legacy types (and per group of Q4_K/Q5_K)
SUPER = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class GgufType:
    """One ``--gguf-type``: the precision and grid of the modules a recipe leaves at 4 bits, whether
    asymmetric ones are K-quants, and, for a K_M mixture, the bits of the tensors llama-quantize
    gives more (``more_bits``: attn_v and ffn_down in its chosen layers, and the head) and of a
    fused attn_qkv (``qkv_bits``). ``file_type``: the LlamaFileType of ``general.file_type``."""

    name: str
    bits: int
    symmetric: bool
    kquants: bool
    file_type: str
    more_bits: int | None = None
    qkv_bits: int | None = None
    guarded_downs: bool = False  # calibrated: the first eighth of ffn_down asymmetric (Q4_1 / Q5_1)
    iq4: str | None = None  # the block type of the symmetric 4-bit modules: IQ4_NL or IQ4_XS
    sized: bool = False  # each module's type chosen by --target-bpw: no mixture of llama-quantize's

    @property
    def head_bits(self) -> int | None:
        """The head's bits (and a tied table's), as llama-quantize gives them: Q6_K in the K_M and
        IQ4 mixtures."""
        return 6 if (self.more_bits or self.iq4) and not self.sized else None

    def scheme(self, bits: int) -> ModuleScheme:
        """A module of ``bits`` bits in this type's grid (6 bits: Q6_K's symmetric one; the IQ4
        types' 5-bit modules: Q5_K's asymmetric one)."""
        return ModuleScheme(bits, GROUPS_OF[bits][0], bits == 6 or (self.symmetric and not self.iq4))


GGUF_TYPES = {t.name: t for t in (
    GgufType("q4_0", 4, True, False, "MOSTLY_Q4_0", guarded_downs=True),
    GgufType("q4_1", 4, False, False, "MOSTLY_Q4_1"),
    GgufType("q5_0", 5, True, False, "MOSTLY_Q5_0", guarded_downs=True),
    GgufType("q5_1", 5, False, False, "MOSTLY_Q5_1"),
    GgufType("q4_k", 4, False, True, "MOSTLY_Q4_K_S"),  # every module Q4_K, like llama-quantize --pure
    GgufType("q5_k", 5, False, True, "MOSTLY_Q5_K_S"),
    GgufType("q6_k", 6, True, True, "MOSTLY_Q6_K"),
    GgufType("q4_k_m", 4, False, True, "MOSTLY_Q4_K_M", more_bits=6, qkv_bits=5),
    GgufType("q5_k_m", 5, False, True, "MOSTLY_Q5_K_M", more_bits=6, qkv_bits=6),
    GgufType("iq4_nl", 4, True, True, "MOSTLY_IQ4_NL", iq4="IQ4_NL"),
    GgufType("iq4_xs", 4, True, True, "MOSTLY_IQ4_XS", iq4="IQ4_XS"),
)}
IQ4_MORE_BITS = 5  # the IQ4 mixtures' attn_v (grouped-query models) and early ffn_down (no imatrix): Q5_K
IQ4_GQA = 4  # query heads per key/value head from which the IQ4 mixtures give attn_v more bits
SIZED = GgufType("target-bpw", 4, True, True, "MOSTLY_IQ4_XS", iq4="IQ4_XS", sized=True)
"""--target-bpw's file: a symmetric 4-bit module is IQ4_XS, an asymmetric one Q4_K, 5 bits Q5_K, 6
bits Q6_K (or their fallbacks), each module's bits chosen by the size target."""
ALL_TYPES = {**GGUF_TYPES, SIZED.name: SIZED}
DEFAULT = {True: GGUF_TYPES["q4_0"], False: GGUF_TYPES["q4_1"]}  # without --gguf-type, by the grid
_BLOCK_ID = re.compile(r"^blk\.(\d+)\.")


def mixture_bits(gguf_type: GgufType, names: dict[str, list[str]], arch: str) -> dict[str, int]:
    """Module -> the bits a K_M mixture gives it instead of the type's own, by the GGUF names of
    its weights (module -> names), as llama-quantize's Q4_K_M and Q5_K_M choose: attn_v by its
    order among the attn_v tensors, ffn_down by its layer, a fused attn_qkv always."""
    if gguf_type.more_bits is None:
        return {}
    first = {m: n[0] for m, n in names.items() if n}
    values = sorted((m for m, n in first.items() if n.endswith(".attn_v.weight")), key=lambda m: _layer(first[m]))
    downs = _ffn_down_layers(names)
    bits = {m: gguf_type.more_bits for i, m in enumerate(values) if more_bits_layer(i, len(values))}
    for m, layer in downs.items():
        if arch == "falcon" and gguf_type.name == "q4_k_m":
            if layer < len(downs) // 16:
                bits[m] = 6
            elif more_bits_layer(layer, len(downs)):
                bits[m] = 5
        elif more_bits_layer(layer, len(downs)):
            bits[m] = gguf_type.more_bits
    bits.update({m: gguf_type.qkv_bits for m, n in first.items() if n.endswith(".attn_qkv.weight")})
    return bits


def iq4_mixture_bits(gguf_type: GgufType, names: dict[str, list[str]], gqa: int, calibrated: bool) -> dict[str, int]:
    """Module -> the bits an IQ4 file gives it instead of 4, as llama-quantize's IQ4_NL and IQ4_XS
    choose: every attn_v of a model with ``gqa`` >= 4 query heads per key/value head, and without
    an importance matrix (an uncalibrated run) the first eighth of ffn_down, each Q5_K."""
    if not gguf_type.iq4 or gguf_type.sized:
        return {}
    first = {m: n[0] for m, n in names.items() if n}
    bits = {m: IQ4_MORE_BITS for m, n in first.items() if n.endswith(".attn_v.weight") and gqa >= IQ4_GQA}
    if not calibrated:
        downs = _ffn_down_layers(names)
        bits.update({m: IQ4_MORE_BITS for m, layer in downs.items() if layer < len(downs) // 8})
    return bits


def guarded_downs(gguf_type: GgufType, names: dict[str, list[str]]) -> set[str]:
    """The modules whose weight is an ffn_down in the first eighth of the ffn_down tensors (by
    layer): llama-quantize stores them in the asymmetric type of the same bits (Q4_1 for Q4_0,
    Q5_1 for Q5_0) when it is given an importance matrix, as a calibrated int4q run is."""
    if not gguf_type.guarded_downs:
        return set()
    downs = _ffn_down_layers(names)
    return {m for m, layer in downs.items() if layer < len(downs) // 8}


def _ffn_down_layers(names: dict[str, list[str]]) -> dict[str, int]:
    """Module -> its layer, for the modules whose weight is an ffn_down (by its first GGUF name)."""
    return {m: _layer(n[0]) for m, n in names.items() if n and n[0].endswith(".ffn_down.weight")}


def _layer(name: str) -> int:
    m = _BLOCK_ID.match(name)
    return int(m.group(1)) if m else 0


def fallback(scheme: ModuleScheme, k: int, gguf_type: GgufType) -> tuple[ModuleScheme, str | None]:
    """The scheme a module with input dim k is stored with, and a note where that is not its own:
    kept in bf16 where 32 does not divide k; where 256 does not, Q4_K becomes Q5_0, Q5_K becomes
    Q5_1, Q6_K becomes Q8_0 and IQ4_XS becomes IQ4_NL, as llama-quantize falls back."""
    if scheme.kept:
        return scheme, None
    if k % BLOCK:
        return ModuleScheme(KEPT_BITS), f"K={k} is not a multiple of GGUF's {BLOCK}-weight blocks: kept in bf16"
    if k % SUPER == 0:
        return scheme, None
    why = f"K={k} is not a multiple of the {SUPER}-weight super-blocks"
    if gguf_type.iq4 == "IQ4_XS" and scheme.symmetric and scheme.bits == 4:
        return scheme, f"{why}: IQ4_NL for IQ4_XS"
    if scheme.bits == 6:
        return ModuleScheme(8, None, True), f"{why}: Q8_0 for Q6_K"
    if gguf_type.kquants and not scheme.symmetric and scheme.bits == 4:
        return ModuleScheme(5, BLOCK, True), f"{why}: Q5_0 for Q4_K"
    if gguf_type.kquants and not scheme.symmetric and scheme.bits == 5:
        return scheme, f"{why}: Q5_1 for Q5_K"
    return scheme, None
