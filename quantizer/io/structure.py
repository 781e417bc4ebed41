"""Which checkpoint tensors are linear weights, the vocabulary table and the head, decided from
the model's own module tree built on the meta device (no weights are allocated)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from ..errors import InputError, UnsupportedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelStructure:
    """Module names (no ``.weight`` suffix) of a causal LM's linears, embedding and head.

    ``transposed``: the linears whose checkpoint weight is [in, out] (transformers' ``Conv1D``);
    int4q quantizes their transpose, so every quantized weight is [out, in]. ``left_out``: per
    module type whose matrices int4q does not quantize, (type, its first module, module count,
    parameters). ``params``: the model's parameter count (a tied table once)."""

    linears: tuple[str, ...]
    embedding: str | None
    head: str | None
    tied: bool
    transposed: frozenset[str] = frozenset()
    left_out: tuple[tuple[str, str, int, int], ...] = ()
    params: int = 0

    def linear_shape(self, module: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The [out, in] shape of ``module``'s weight, given its checkpoint shape."""
        return tuple(reversed(shape)) if module in self.transposed else tuple(shape)

    def as_linear(self, module: str, weight: torch.Tensor) -> torch.Tensor:
        """``module``'s checkpoint weight as the [out, in] weight int4q quantizes."""
        return weight.t().contiguous() if module in self.transposed else weight

    def left_out_note(self) -> str | None:
        """One line naming the module types left in bf16 and their share of the parameters."""
        if not self.left_out or not self.params:
            return None
        parts = [f"{kind} ({first}{f' and {count - 1} more' if count > 1 else ''}: "
                 f"{100 * n / self.params:.1f}% of the parameters)" for kind, first, count, n in self.left_out]
        return "kept in bf16, no int4q quantizer for their type: " + ", ".join(parts)

    @property
    def decoder_linears(self) -> tuple[str, ...]:
        """The linears other than the output head."""
        return tuple(n for n in self.linears if n != self.head)

    def quantized_modules(self, ignore: tuple[str, ...], quantize_embedding: bool, tied_output: bool) -> list[str]:
        """The modules a quantized checkpoint stores quantized: every linear not ignored, the table
        when ``quantize_embedding``, and the head unless it is tied to the table (or ignored)."""
        from ..schema.config import matches_ignore

        modules = [m for m in self.decoder_linears if not matches_ignore(m, ignore)]
        if self.embedding and quantize_embedding:
            modules.append(self.embedding)
        if self.head and not tied_output and not matches_ignore(self.head, ignore):
            modules.append(self.head)
        return modules


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions")
"""Sizes that must be positive integers wherever a config gives them (null: the model's default)."""


def check_sizes(config_dict: dict) -> None:
    """InputError naming the first size in config.json (or its text_config) that is not a positive integer."""
    for where, cfg in (("", config_dict), ("text_config.", config_dict.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in SIZE_KEYS:
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"config.json: {where}{key} is {value!r}; it must be a positive integer")


WIDTH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "head_dim", "n_embd", "n_inner")
PACKING = 8
"""The most weights one stored element holds (a GPTQ int32 holds eight 4-bit codes)."""


def check_against_checkpoint(config_dict: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """InputError, before a model is built from config.json, where it describes more than the
    checkpoint's tensors (``shapes``, read from the shard headers) can hold: more decoder layers
    than tensors (each layer has one at least), or a width larger than any tensor's dimension
    times :data:`PACKING` (building such a model would try to allocate it)."""
    cfg = config_dict.get("text_config") if isinstance(config_dict.get("text_config"), dict) else config_dict
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    if isinstance(layers, int) and layers > len(shapes):
        raise InputError(f"config.json says {layers} layers, but the checkpoint holds only {len(shapes)} tensors; "
                         "fix num_hidden_layers or point at the checkpoint it describes")
    widest = max((d for shape in shapes.values() for d in shape), default=0)
    for key in WIDTH_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and value > PACKING * widest:
            raise InputError(f"config.json says {key} {value}, but no tensor of the checkpoint is wider than {widest}; "
                             f"fix {key} or point at the checkpoint it describes")


def build_config(config_dict: dict):
    """A transformers config object from a config.json dict (no network); its sizes are checked first."""
    from transformers import AutoConfig

    check_sizes(config_dict)
    cfg = dict(config_dict)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise InputError("config.json has no model_type")
    cfg.pop("quantization_config", None)
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as e:
        import transformers

        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if "Unrecognized model" in str(e) or isinstance(e, KeyError):
            detail = "an unknown model type"
        raise UnsupportedError(f"transformers {transformers.__version__} cannot build model_type {model_type!r} "
                               f"({detail}); upgrade transformers or fix config.json") from None
    except Exception as e:  # transformers' own validators (strict dataclasses) raise their own types
        detail = " ".join(line.strip() for line in str(e).strip().splitlines()[:2])[:200] or type(e).__name__
        raise InputError(f"config.json is not a valid {model_type!r} config ({detail}); fix config.json") from None


def base_model_class(config_dict: dict) -> str | None:
    """The name of config.json's model type's base model class (``Qwen2Model``), where transformers has one."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return MODEL_MAPPING_NAMES.get(config_dict.get("model_type"))


def is_base_model(config_dict: dict) -> bool:
    """True where config.json's architectures names its model type's base model (``Qwen2Model``,
    ``Gemma3TextModel``: no head, tensors without the causal LM's ``model.`` prefix), as base and
    embedding models ship."""
    archs = config_dict.get("architectures") or [None]
    return archs[0] is not None and archs[0] == base_model_class(config_dict)


def build_empty_model(config_dict: dict) -> torch.nn.Module:
    """The architecture with parameters on the meta device and buffers (rotary tables) on the CPU:
    the causal LM, or the base model where config.json names it (:func:`is_base_model`)."""
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    config = build_config(config_dict)
    base = is_base_model(config_dict)
    with init_empty_weights(include_buffers=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = (AutoModel if base else AutoModelForCausalLM).from_config(config, dtype=torch.bfloat16)
        except ValueError as e:
            kind = "base model" if base else "causal LM"
            raise UnsupportedError(f"transformers has no {kind} for this config ({str(e).splitlines()[0]})") from None
    return model.eval()


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The name and ModuleList of the decoder layers: the list of num_hidden_layers blocks."""
    count = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return name, module
    raise UnsupportedError(f"cannot find the {count} decoder layers of {type(model).__name__}")


def tie_word_embeddings(config_dict: dict) -> bool:
    text = config_dict.get("text_config") or {}
    return bool(config_dict.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def is_transposed_linear(module: torch.nn.Module) -> bool:
    """True for transformers' ``Conv1D``: a linear whose weight is stored [in, out]."""
    from transformers.pytorch_utils import Conv1D

    return type(module) is Conv1D


def is_linear(module: torch.nn.Module) -> bool:
    """True for a module int4q quantizes as a linear: ``nn.Linear`` or transformers' ``Conv1D``."""
    return type(module) is torch.nn.Linear or is_transposed_linear(module)


def linear_dims(module: torch.nn.Module) -> tuple[int, int]:
    """(out, in) of a module for which :func:`is_linear` holds."""
    out, inp = module.weight.shape
    return (inp, out) if is_transposed_linear(module) else (out, inp)


def inspect_structure(config_dict: dict) -> ModelStructure:
    model = build_empty_model(config_dict)
    names = {id(m): n for n, m in model.named_modules()}
    linears = tuple(n for n, m in model.named_modules() if is_linear(m))
    transposed = frozenset(n for n, m in model.named_modules() if is_transposed_linear(m))
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    emb_name = names.get(id(emb)) if emb is not None else None
    head_name = names.get(id(head)) if head is not None else None
    if head is not None and type(head) is not torch.nn.Linear:
        head_name = None
    covered = {id(m) for m in (emb, head) if m is not None} | {id(model.get_submodule(n)) for n in linears}
    params = sum(p.numel() for p in model.parameters())
    return ModelStructure(linears, emb_name, head_name, tie_word_embeddings(config_dict), transposed,
                          _left_out(model, covered), params)


def _left_out(model: torch.nn.Module, covered: set[int]) -> tuple[tuple[str, str, int, int], ...]:
    """(type, first module, modules, parameters) per module type holding a matrix that no
    quantizable module holds, the largest share first."""
    counts: dict[str, list] = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if id(module) in covered or not any(p.dim() >= 2 for p in own):
            continue
        entry = counts.setdefault(type(module).__name__, [name, 0, 0])
        entry[1] += 1
        entry[2] += sum(p.numel() for p in own)
    return tuple((kind, *entry) for kind, entry in sorted(counts.items(), key=lambda kv: -kv[1][2]))


def architecture_mismatches(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]],
                            tied_head: str | None = None) -> list[str]:
    """Problems between a checkpoint's tensors (name -> shape; a quantized module appears as its
    ``<module>.weight`` with the unpacked [N, K]) and ``model``'s parameters: a parameter missing or
    misshaped, or a tensor with no place in the model. A tied head's redundant copy is allowed."""
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers()}
    problems = []
    for name, want in params.items():
        if tied_head and name.startswith(tied_head + "."):
            continue  # the table serves as the head
        if name not in shapes:
            problems.append(f"{name}: missing")
        elif tuple(shapes[name]) != want:
            problems.append(f"{name}: shape {list(shapes[name])}, the model expects {list(want)}")
    for name in sorted(set(shapes) - set(params) - buffers):
        if not (tied_head and name.startswith(tied_head + ".")):
            problems.append(f"{name}: stray tensor the model has no place for")
    return problems


def holds_only_the_base_model(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], head: str | None,
                              tied_head: str | None = None) -> bool:
    """Whether a checkpoint's tensors (name -> shape) that do not fit the causal LM ``model`` are
    exactly its base model's: every name without the causal LM's ``base_model_prefix`` and no
    ``head`` (a base or embedding model saved with a causal LM's config.json)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not shapes or any(n.startswith(prefix + ".") for n in shapes):
        return False
    problems = architecture_mismatches(model, {f"{prefix}.{n}": s for n, s in shapes.items()}, tied_head)
    return all(head and p.startswith(f"{head}.") and p.endswith(": missing") for p in problems)
