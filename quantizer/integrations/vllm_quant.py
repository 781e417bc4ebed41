"""cpu_int4 as a vLLM quantization method (registered on import, by vllm_plugin.register).

Each quantized linear and vocabulary table loads the checkpoint's tensors as vLLM parameters
(``weight_packed``, ``weight_scale``, ``weight_zero``), and after loading becomes int4q's own
runtime module (:class:`~quantizer.runtime.nn.int4.Int4Linear` or the int8 one), behind int4q's
custom op, which vLLM's torch.compile does not trace into. A step of up to ``loader.DECODE_ROWS``
rows (one token of each of up to that many sequences: batched decode) goes through the decode
kernels, which read the packed weight directly; larger steps (prompts) dequantize it, or take the
int8 path, as int4q's runtime chooses (``INT4Q_ACTIVATIONS``; the head stays exact). A module the
plugin cannot run (a fused vLLM linear whose parts have different schemes) is refused at load,
naming it; nothing falls back to bf16.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.utils import set_weight_attrs

from ..formats.packing import unpack_nibbles
from ..io.structure import inspect_structure
from ..methods.grid import dequantize_codes
from ..runtime.activations import EXACT
from ..runtime.activations import current as current_activations
from ..runtime.loader import kernel_options, with_decode_rows
from ..runtime.nn.int4 import Int4Linear
from ..runtime.nn.int8 import Int8Linear
from ..schema.config import QuantizationConfig as Int4qConfig
from ..schema.scheme import KEPT_BITS, ModuleScheme

NAME = "cpu_int4"
KERNEL = "int4q_kernel"  # the attribute holding a layer's int4q module after loading
def _tensor_shapes(scheme: ModuleScheme, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, int]]]:
    """The cpu_int4 tensors of one [N, K] module (formats/cpu_int4.py)."""
    if scheme.bits == 8:
        return {"weight_packed": (torch.int8, (n, k)), "weight_scale": (torch.bfloat16, (n, 1))}
    if k % scheme.group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {scheme.group_size}")
    groups = (n, k // scheme.group_size)
    return {"weight_packed": (torch.uint8, (n, k // 2)), "weight_scale": (torch.bfloat16, groups),
            "weight_zero": (torch.bfloat16, groups)}


class _Int4qMethod(QuantizeMethodBase):
    """Loads one module's cpu_int4 tensors and runs them as int4q's Int4Linear / Int8Linear."""

    def __init__(self, scheme: ModuleScheme, qconfig: Int4qConfig, exact: bool = False):
        self.scheme, self.qconfig, self.exact = scheme, qconfig, exact

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        n = sum(output_partition_sizes)
        for name, (dtype, shape) in _tensor_shapes(self.scheme, n, input_size_per_partition).items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
            layer.register_parameter(name, param)

    def _build(self, layer: torch.nn.Module) -> torch.nn.Module:
        options = with_decode_rows(kernel_options(self.qconfig, self.scheme.bits,
                                                  EXACT if self.exact else current_activations()))
        if self.scheme.bits == 8:
            return Int8Linear(layer.weight_packed.data, layer.weight_scale.data, **options)
        return Int4Linear.from_row_major(layer.weight_packed.data, layer.weight_scale.data, layer.weight_zero.data,
                                         self.scheme.group_size, **options)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        setattr(layer, KERNEL, self._build(layer))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = getattr(layer, KERNEL)(x)
        return out if bias is None else out + bias


class _LinearMethod(_Int4qMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        for name in ("weight_packed", "weight_scale", "weight_zero"):  # the kernel holds what it needs
            if hasattr(layer, name):
                delattr(layer, name)


class _TableMethod(_Int4qMethod):
    """A vocabulary table (rows looked up from the row-major tensors, which stay) or a head (the
    kernel); a head tied to the table shares its tensors and its kernel."""

    def __init__(self, scheme: ModuleScheme, qconfig: Int4qConfig, is_head: bool):
        super().__init__(scheme, qconfig, exact=True)  # its error lands on the logits unfiltered
        self.is_head = is_head

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "int4q_tied_to", None) is not None:
            return  # the table builds the kernel the two share
        if self.is_head or getattr(layer, "int4q_has_tied_head", False):
            super().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        owner = getattr(layer, "int4q_tied_to", None) or layer
        return super().apply(owner, x, bias)

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        codes = layer.weight_packed.data.index_select(0, flat)
        scale = layer.weight_scale.data.index_select(0, flat)
        if self.scheme.bits == 8:
            rows = (codes.to(torch.float32) * scale.to(torch.float32)).to(torch.bfloat16)
        else:
            rows = dequantize_codes(unpack_nibbles(codes), scale, layer.weight_zero.data.index_select(0, flat))
        return rows.reshape(*ids.shape, rows.shape[-1])

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        for name in ("weight_packed", "weight_scale", "weight_zero"):
            if hasattr(layer, name):
                delattr(layer, name)
            if hasattr(embed_tokens, name):
                setattr(layer, name, getattr(embed_tokens, name))
        object.__setattr__(layer, "int4q_tied_to", embed_tokens)  # a reference, not a second submodule
        embed_tokens.int4q_has_tied_head = True
        return layer


@register_quantization_config(NAME)
class CpuInt4VllmConfig(QuantizationConfig):
    """A cpu_int4 checkpoint's ``quantization_config``, read by int4q's own parser."""

    def __init__(self, qconfig: Int4qConfig):
        super().__init__()
        self.qconfig = qconfig
        self.table: str | None = None  # the vocabulary table's module name in the checkpoint

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Learn the table's checkpoint name (vLLM may build it with no prefix)."""
        if hf_config is not None:
            self.table = inspect_structure(hf_config.to_dict()).embedding

    def __repr__(self) -> str:
        return f"CpuInt4VllmConfig({self.qconfig.to_dict()})"

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CpuInt4VllmConfig":
        return cls(Int4qConfig.from_dict(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, VocabParallelEmbedding):
            is_head = isinstance(layer, ParallelLMHead)
            scheme = self._table_scheme(prefix if is_head else self.table or prefix)
            if scheme.kept:
                return UnquantizedEmbeddingMethod()
            return _TableMethod(scheme, self.qconfig, is_head)
        if isinstance(layer, LinearBase):
            scheme = self.scheme_of(prefix)
            return UnquantizedLinearMethod() if scheme.kept else _LinearMethod(scheme, self.qconfig)
        return None

    def _table_scheme(self, name: str) -> ModuleScheme:
        if name == self.table and not self.qconfig.quantize_embedding:
            return ModuleScheme(KEPT_BITS)
        return self.scheme_of(name)

    def scheme_of(self, prefix: str) -> ModuleScheme:
        """The scheme of vLLM's module ``prefix``; for a fused one (qkv_proj, gate_up_proj) the one
        scheme of its parts, or a ValueError naming them."""
        last = prefix.rsplit(".", 1)[-1]
        parts = self.packed_modules_mapping.get(last)
        if not parts:
            return self.qconfig.scheme_for(prefix)
        base = prefix[: -len(last)]
        schemes = {p: self.qconfig.scheme_for(base + p) for p in parts}
        if len(set(schemes.values())) > 1:
            listed = ", ".join(f"{base}{p}: {_describe(s)}" for p, s in schemes.items())
            raise ValueError(f"int4q's vLLM plugin runs {prefix} as one fused linear, but its parts have different "
                             f"schemes ({listed}); quantize them alike (e.g. --recipe table8, or one --override "
                             "for all of them)")
        return next(iter(schemes.values()))


def _describe(scheme: ModuleScheme) -> str:
    if scheme.kept:
        return "kept"
    if scheme.bits == 8:
        return "8-bit"
    return f"4-bit g{scheme.group_size}{' symmetric' if scheme.symmetric else ''}"
