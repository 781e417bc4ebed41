"""cpu_int4 as a transformers quantization method: after ``import quantizer``,
``AutoModelForCausalLM.from_pretrained(folder)`` of a cpu_int4 checkpoint returns the same int4
modules and kernels as :func:`quantizer.runtime.load_model`, through transformers' own extension
points (``register_quantization_config``, ``register_quantizer``, an ``HfQuantizer``).

Before transformers loads the weights, each quantized module (and a head that will share the
quantized table) is replaced by a holder of its packed tensors, so transformers loads them like
any other tensor; afterwards the holders become the runtime's int4/int8 modules. ``save_pretrained``
writes the packed tensors as they were read, so the folder it writes verifies like the original."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.quantizers import (
    HfQuantizer,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import InputError
from ..formats import RUNTIME_FORMAT
from ..io.checkpoint import CheckpointReader
from ..io.structure import tie_word_embeddings
from ..runtime.nn.swap import set_module
from ..schema.config import QuantizationConfig


class _Held(torch.nn.Module):
    """Holds one quantized module's checkpoint tensors (``weight_packed``... as parameters) while
    transformers loads them; created on the meta device like the rest of the skeleton."""

    def __init__(self, infos: dict):
        super().__init__()
        for attr, info in infos.items():
            self.register_parameter(attr, torch.nn.Parameter(
                torch.empty(info.shape, dtype=info.dtype, device="meta"), requires_grad=False))


@dataclass(frozen=True)
class _Info:
    name: str
    dtype: torch.dtype
    shape: tuple


class _Tensors:
    """Loaded tensors behind the part of CheckpointReader's interface the runtime's installer uses."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.infos = {n: _Info(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()}

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _initialize_buffers(model, module: torch.nn.Module) -> None:
    """Give a module that sat out the loading its buffers (Gemma's embedding scale) the values the
    model's own initialisation gives them, as transformers does for the modules it loaded."""
    meta = [name for name, buf in module._buffers.items() if buf is not None and buf.is_meta]
    if not meta:
        return
    for name in meta:
        module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
    with torch.no_grad():
        model._init_weights(module)


def _name_of(model, module) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)


@contextlib.contextmanager
def _plain_torch_defaults():
    """CPU tensors in fp32 by default: transformers builds the skeleton under a meta device and
    the checkpoint's dtype as defaults, which the packing code must not inherit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(previous)


@register_quantization_config(RUNTIME_FORMAT)
class CpuInt4Config(QuantizationConfigMixin):
    """The checkpoint's ``quantization_config``, kept as written (see :mod:`quantizer.schema.config`)."""

    def __init__(self, **fields):
        fields.pop("quant_method", None)
        self._fields = fields
        self.quant_method = RUNTIME_FORMAT
        QuantizationConfig.from_dict(self.to_dict())  # a bad config fails here, with int4q's message

    def __getattr__(self, name):
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def to_dict(self) -> dict:
        return {"quant_method": RUNTIME_FORMAT, **self._fields}

    def to_diff_dict(self) -> dict:
        return self.to_dict()


@register_quantizer(RUNTIME_FORMAT)
class CpuInt4Quantizer(HfQuantizer):
    """Loads cpu_int4 checkpoints (it cannot quantize a float model: use ``int4q quantize``)."""

    requires_calibration = True

    def __init__(self, quantization_config: CpuInt4Config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.source: Path | None = None
        self.quantized: set[str] = set()
        self.tied_head: str | None = None
        self.originals: dict[str, torch.nn.Module] = {}

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
        if devices - {None, "cpu", torch.device("cpu")}:
            raise ValueError(f"cpu_int4 checkpoints run on the CPU; load without device_map={device_map!r}")

    def update_dtype(self, dtype):
        return torch.bfloat16

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        """Stand a holder of the checkpoint's tensors in for each quantized module (and for a head
        that will share the quantized table), so transformers loads the packed tensors as they are."""
        from ..runtime.loader import is_quantized_tensor, quantized_module_names

        if not checkpoint_files:
            raise ValueError("cpu_int4: from_pretrained found no checkpoint files to read the packed weights from")
        self.source = Path(checkpoint_files[0]).parent
        reader = CheckpointReader(self.source)
        self.quantized = set(quantized_module_names(reader))
        head = model.get_output_embeddings()
        emb_name = _name_of(model, model.get_input_embeddings())
        self.tied_head = (_name_of(model, head) if head is not None and emb_name in self.quantized
                          and tie_word_embeddings(model.config.to_dict()) else None)
        for name in sorted(self.quantized) + ([self.tied_head] if self.tied_head else []):
            specs = {n[len(name) + 1:]: info for n, info in reader.infos.items()
                     if n.startswith(name + ".") and is_quantized_tensor(n, self.quantized)}
            self.originals[name] = model.get_submodule(name)
            set_module(model, name, _Held(specs))
        if self.tied_head:  # it will share the table's quantized buffers: there is no weight to tie
            model.all_tied_weights_keys = {k: v for k, v in getattr(model, "all_tied_weights_keys", {}).items()
                                           if not k.startswith(self.tied_head + ".")}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Put the original modules back and turn them into the runtime's int4/int8 modules."""
        from ..runtime.loader import QUANTIZED_MODULES, install_quantized_modules
        from ..runtime.nn.fusion import fuse_projections
        from ..runtime.nn.placement import onto_huge_pages

        loaded = {}
        for name, original in self.originals.items():
            loaded.update({f"{name}.{attr}": p.data for attr, p in model.get_submodule(name)._parameters.items()})
            set_module(model, name, original)
        qc = QuantizationConfig.from_dict(self.quantization_config.to_dict())
        with _plain_torch_defaults():
            for original in self.originals.values():
                _initialize_buffers(model, original)
            install_quantized_modules(model, _Tensors(loaded), qc, tied=self.tied_head is not None)
        self.originals.clear()
        fuse_projections(model)
        onto_huge_pages(m for m in model.modules() if isinstance(m, QUANTIZED_MODULES))
        return model

    def get_state_dict_and_metadata(self, model):
        """The packed tensors as the checkpoint holds them, plus the model's own other tensors."""
        from ..runtime.loader import is_quantized_tensor

        if self.source is None or not self.source.is_dir():
            raise InputError(f"cpu_int4: the checkpoint this model was loaded from ({self.source}) is gone; "
                             "save_pretrained copies its packed tensors, so reload it from a folder that exists")
        reader = CheckpointReader(self.source)
        own = model.state_dict()
        state = {name: own[name] if name in own and not is_quantized_tensor(name, self.quantized) else reader.get(name)
                 for name in reader.infos}
        return state, {}

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False
