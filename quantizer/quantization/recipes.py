"""Per-module precision: named recipes, ``--override PATTERN=BITS[:GROUP]``, and the group-size
fallback, turned into one ModuleScheme per quantized module. Pure functions of names and shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from ..schema.config import matches_ignore
from ..schema.scheme import (
    BITS,
    GROUP_SIZES,
    GROUPS_OF,
    KEPT_BITS,
    ModuleScheme,
    more_bits_layer,
)

MORE_BITS_SUFFIXES = ("v_proj", "down_proj")  # llama.cpp's attn_v and ffn_down
RECIPES = {
    "all4": "every module 4-bit",
    "table8": "the vocabulary table and the head 8-bit, the rest 4-bit",
    "mixed": "as table8, and v_proj and down_proj 8-bit in the first and last eighth of the layers and "
             "every third layer between (llama.cpp's Q4_K_M choice of layers)",
}
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Override:
    """``--override PATTERN=BITS[:GROUP]``: modules named PATTERN (or ending ``.PATTERN``) get BITS."""

    pattern: str
    bits: int
    group_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Override":
        m = re.fullmatch(r"([^=\s]+)=(\d+)(?::(\d+))?", text.strip())
        if not m:
            raise InputError(f"--override {text!r}: expected PATTERN=BITS or PATTERN=4:GROUP, e.g. down_proj=8")
        bits, group = int(m.group(2)), int(m.group(3)) if m.group(3) else None
        if bits not in BITS or (group is not None and (bits != 4 or group not in GROUP_SIZES)):
            raise InputError(f"--override {text!r}: bits must be one of {', '.join(map(str, BITS))} (5 and 6: GGUF "
                             f"only), and a group (4 bits only) one of {', '.join(map(str, GROUP_SIZES))}")
        return cls(m.group(1), bits, group)


def recipe_bits(recipe: str, module: str, table_or_head: bool, n_layers: int) -> int:
    """The bits a recipe gives one module."""
    if recipe not in RECIPES:
        raise InputError(f"--recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if recipe == "all4":
        return 4
    if table_or_head:
        return 8
    layer = _LAYER.search(module)
    if recipe == "mixed" and layer and module.endswith(MORE_BITS_SUFFIXES) and more_bits_layer(int(layer.group(1)), n_layers):
        return 8
    return 4


def fallback_group(k: int, requested: int) -> int | None:
    """The largest supported group not above ``requested`` that divides ``k``; None when none does."""
    return next((g for g in sorted(GROUP_SIZES, reverse=True) if g <= requested and k % g == 0), None)


def module_scheme(module: str, k: int, bits: int, group: int, symmetric: bool,
                  overrides: tuple[Override, ...]) -> tuple[ModuleScheme, str | None]:
    """One module's scheme after overrides (the last matching one wins) and the group fallback;
    with it, a note when the fallback changed the group or the bits."""
    for o in overrides:
        if matches_ignore(module, (o.pattern,)):
            bits, group = o.bits, o.group_size or group
    if bits == KEPT_BITS:
        return ModuleScheme(KEPT_BITS), None
    if bits == 8:
        return ModuleScheme(8, None, True), None
    if bits != 4:  # GGUF's 5 and 6 bits: their type's one group size
        own = GROUPS_OF[bits][0]
        if k % own:
            return ModuleScheme(8, None, True), f"{module}: K={k} is not a multiple of {own}, so it is 8-bit"
        return ModuleScheme(bits, own, symmetric or bits == 6), None
    if k % group == 0:
        return ModuleScheme(4, group, symmetric), None
    fallback = fallback_group(k, group)
    if fallback is None:
        return ModuleScheme(8, None, True), f"{module}: K={k} is not a multiple of 32, so it is 8-bit"
    return ModuleScheme(4, fallback, symmetric), f"{module}: group {fallback} (K={k} is not a multiple of {group})"


AUTO_GROUP_SIZES = (128, 64, 32)


def auto_group(k_dims: list[int]) -> int:
    """The largest of 128, 64, 32 that divides every input dim that 32 divides (the others fall back)."""
    dims = [k for k in k_dims if k % 32 == 0]
    return next(g for g in AUTO_GROUP_SIZES if all(k % g == 0 for k in dims))


def assign_schemes(k_dims: dict[str, int], base_bits: dict[str, int], requested_group: int | None, symmetric: bool,
                   overrides: tuple[Override, ...], strict: bool) -> tuple[int, dict[str, ModuleScheme], dict[str, str]]:
    """(the checkpoint-wide group, each module's scheme, a note per module whose group or bits
    the fallback changed). ``k_dims`` and ``base_bits`` are by module."""
    group = requested_group or auto_group([k for m, k in k_dims.items() if base_bits[m] == 4])
    schemes, fallbacks = {}, {}
    for module, k in k_dims.items():
        schemes[module], note = module_scheme(module, k, base_bits[module], group, symmetric, overrides)
        if note:
            fallbacks[module] = note
    if strict and requested_group and fallbacks:
        _refuse_fallbacks(requested_group, {m: k_dims[m] for m in fallbacks}, list(k_dims.values()))
    return group, schemes, fallbacks


def _refuse_fallbacks(group: int, bad: dict[str, int], k_dims: list[int]) -> None:
    listed = ", ".join(f"{m} (K={k})" for m, k in sorted(bad.items())[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    sizes = ", ".join(str(g) for g in GROUP_SIZES if all(k % g == 0 for k in k_dims)) or "none"
    raise InputError(f"group size {group} does not divide {listed}{more}; sizes that work: {sizes} "
                     "(without --strict-group-size those tensors fall back to a smaller group)")
