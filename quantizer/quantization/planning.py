"""Plan a quantization: check the checkpoint and the options against each other and decide, for
every tensor, whether it is copied, dropped, or quantized and with which scheme. Reads only
config.json and shard headers (with a size target, each quantized weight once more, to measure
it), and raises before anything is written."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InputError
from ..formats import RUNTIME_FORMAT, CheckpointFormat, SourceModel, get_format
from ..formats.sources import QuantizedCheckpoint, SourceScheme, float_config, open_quantized
from ..io.checkpoint import CheckpointReader, TensorInfo, read_config
from ..io.shards import TensorSpec
from ..io.structure import (
    ModelStructure,
    architecture_mismatches,
    base_model_class,
    build_empty_model,
    check_against_checkpoint,
    holds_only_the_base_model,
    inspect_structure,
)
from ..methods.grid import Storage
from ..methods.transfer import SourceGrid
from ..schema.config import SOURCE_GRIDS, QuantizationConfig, matches_ignore
from ..schema.methods import UNCALIBRATED
from ..schema.scheme import ModuleScheme
from .budget import SIZE_TARGET, fit_to_size
from .precision import implied_options, separate_head_ok
from .recipes import Override, assign_schemes, recipe_bits

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class QuantizeOptions:
    """User choices. ``group_size=None`` means auto."""

    group_size: int | None = None
    symmetric: bool | None = False  # None: the format's default grid
    clip_search: bool = False
    keep_embedding: bool = False
    untie_head: bool = False
    ignore: tuple[str, ...] = ()
    max_shard_bytes: int = 2 * 1000**3
    method: str = UNCALIBRATED
    checkpoint_format: str = RUNTIME_FORMAT
    recipe: str = "all4"
    embedding_bits: int | None = None  # None: the recipe's (16 with keep_embedding)
    head_bits: int | None = None  # None: the table's when tied, else the recipe's
    overrides: tuple[Override, ...] = ()
    strict_group_size: bool = False
    gguf_type: str | None = None  # the gguf format's block types (None: Q4_0/Q4_1 by the grid)
    target_bpw: float | None = None  # gguf: each module's type chosen for this many bits per weight

    @property
    def output_format(self) -> CheckpointFormat:
        return get_format(self.checkpoint_format, self.gguf_type)


@dataclass(frozen=True)
class QuantizationPlan:
    """Everything decided before the first byte is written.

    ``targets`` maps each output module name to the checkpoint tensor it is quantized from (an
    untied head made from a tied table shares the table's source). ``dropped`` are source tensors
    that are not written at all (a tied head's redundant copy).
    """

    model_dir: Path
    reader: CheckpointReader
    source_config: dict
    structure: ModelStructure
    qconfig: QuantizationConfig
    targets: dict[str, str]
    options: QuantizeOptions
    dropped: frozenset[str] = field(default_factory=frozenset)
    tied_output: bool = False
    source_name: str | None = None  # what the user named (a Hub id or a path), for the model card
    base_model: str | None = None  # the source's Hub id, when one is known (see hub.base_model_id)
    notes: tuple[str, ...] = ()  # choices the plan made that the user did not ask for
    fallbacks: dict[str, str] = field(default_factory=dict)  # module -> why its group or bits differ

    @property
    def format(self) -> CheckpointFormat:
        return self.options.output_format

    def storage_of(self, module: str) -> Storage:
        """How the format stores the grids of ``module``."""
        return self.format.grid_storage(self.scheme_of(module), self.weight_shape(module)[1])

    def scheme_of(self, module: str) -> ModuleScheme:
        return self.qconfig.scheme_for(module)

    @property
    def source_quantized(self) -> bool:
        """Whether the source is a quantized checkpoint read as the float model it stands for."""
        return isinstance(self.reader, QuantizedCheckpoint)

    def source_grid(self, module: str) -> SourceGrid | None:
        """The grid a quantized source stores ``module``'s weight on; None for a float source and
        for a module the source keeps in float."""
        return self.reader.grid(self.targets[module]) if self.source_quantized else None

    def output_config(self) -> dict:
        cfg = copy.deepcopy(self.source_config)
        head = self.structure.head
        cfg["quantization_config"] = self.format.quantization_config(
            self.qconfig, head_quantized=bool(head) and head in self.targets and self.scheme_of(head).bits < 16)
        cfg["tie_word_embeddings"] = self.tied_output
        if isinstance(cfg.get("text_config"), dict) and "tie_word_embeddings" in cfg["text_config"]:
            cfg["text_config"]["tie_word_embeddings"] = self.tied_output
        return cfg

    def reading_order(self) -> list[tuple[TensorInfo, list[str]]]:
        """Each source tensor that is written (the dropped are not), in reading order, with the
        output modules quantized from it (empty: copied)."""
        infos = sorted(self.reader.infos.values(), key=lambda i: (str(i.file), i.name))
        return [(i, self.modules_from(i.name)) for i in infos if i.name not in self.dropped]

    def output_specs(self) -> list[TensorSpec]:
        """Every tensor the output will hold, in writing order."""
        specs = []
        for info, modules in self.reading_order():
            if not modules:
                specs.append(TensorSpec(info.name, info.dtype, info.shape))
            for module in modules:
                specs += self.format.tensor_specs(module, self.weight_shape(module), self.scheme_of(module))
        return specs

    def weight_shape(self, module: str) -> tuple[int, ...]:
        """The [out, in] shape of the weight ``module`` is quantized from."""
        return self.structure.linear_shape(module, self.reader.infos[self.targets[module]].shape)

    def linear_weight(self, module: str, tensor: torch.Tensor) -> torch.Tensor:
        """The source tensor of ``module`` as the [out, in] weight it is quantized from."""
        return self.structure.as_linear(module, tensor)

    def disk_bytes_needed(self, calibration_tokens: int = 0) -> int:
        """Free bytes the run needs: the output's tensors; for a calibrated (GPTQ) run also its
        per-layer state (about the output again) and two sets of fp32 calibration activations."""
        output = sum(spec.nbytes for spec in self.output_specs())
        if not calibration_tokens:
            return output
        hidden = self.source_config.get("hidden_size") or (self.source_config.get("text_config") or {}).get("hidden_size")
        return 2 * output + 2 * calibration_tokens * int(hidden or 0) * 4

    def modules_from(self, tensor_name: str) -> list[str]:
        """Output modules quantized from this checkpoint tensor (empty: copy it)."""
        return [m for m, src in self.targets.items() if src == tensor_name]


def plan_quantization(model_dir: Path, options: QuantizeOptions) -> QuantizationPlan:
    """Check the checkpoint and the options against each other; raise InputError on any problem."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    quantized = open_quantized(model_dir, config)
    notes = []
    if quantized is not None:
        config = float_config(config)
        options, notes = source_defaults(options, quantized.scheme)
    reader = quantized or CheckpointReader(model_dir)
    check_against_checkpoint(config, {n: i.shape for n, i in reader.infos.items()})
    structure = inspect_structure(config)
    infos = reader.infos
    _check_architecture(model_dir, config, structure, infos)
    for name, info in infos.items():
        if not isinstance(info.dtype, torch.dtype):
            raise InputError(f"tensor {name} has dtype {info.dtype}, which int4q cannot read")
    _check_overrides_match(options.overrides, structure)
    fmt = options.output_format
    options = _format_group(options, fmt)
    options, implied = implied_options(options, structure, separate_head_ok(fmt, model_dir, config))
    notes += implied
    targets, dropped, tied_output = _choose_targets(structure, infos, options)
    _check_dtypes_and_shapes(targets, infos)
    base_bits = {m: _base_bits(m, structure, options, config) for m in targets}
    shapes = {m: structure.linear_shape(m, infos[s].shape) for m, s in targets.items()}
    k_dims = {m: shape[1] for m, shape in shapes.items()}
    group, schemes, fallbacks = assign_schemes(k_dims, base_bits, options.group_size, options.symmetric,
                                               options.overrides, options.strict_group_size)
    if fmt.one_group_size:
        _check_one_group(schemes, group, k_dims, fmt)
    layer_shapes = {m: tuple(infos[s].shape) for m, s in targets.items()
                    if m not in (structure.embedding, structure.head)}
    format_notes = fmt.fit_schemes(schemes, k_dims, SourceModel(model_dir, config, layer_shapes),
                                   calibrated=options.method != UNCALIBRATED)
    calibration = {SOURCE_GRIDS: quantized.scheme.title} if quantized is not None else {}
    if options.target_bpw is not None:
        sized, format_notes, calibration[SIZE_TARGET] = _fit_to_size(options.target_bpw, reader, structure,
                                                                     targets, schemes, shapes, fmt)
        schemes.update(sized)
        notes.append(_size_note(calibration[SIZE_TARGET]))
    fallbacks.update(format_notes)
    notes += _grouped_notes(format_notes)
    left_out = structure.left_out_note()
    if left_out:
        notes.append(left_out)
    _check_schemes(schemes, fmt)
    emb = structure.embedding
    _check_out_dims({targets[m]: shapes[m][0] for m in targets if schemes[m].bits == 4 and (m != emb or tied_output)},
                    fmt.out_dim_multiple)
    default = ModuleScheme(4, group, options.symmetric)
    qconfig = QuantizationConfig(
        group_size=group,
        ignore=tuple(options.ignore),
        quantize_embedding=emb in targets,
        method=options.method,
        symmetric=options.symmetric,
        clip_search=options.clip_search,
        calibration=calibration,
        modules={m: scheme.to_dict() for m, scheme in schemes.items() if scheme != default},
    )
    return QuantizationPlan(model_dir, reader, config, structure, qconfig, targets, options, frozenset(dropped),
                            tied_output, notes=tuple(notes), fallbacks=fallbacks)


def source_defaults(options: QuantizeOptions, scheme: SourceScheme) -> tuple[QuantizeOptions, list[str]]:
    """A quantized source's grid and group size become the run's where the user chose none and the
    output can hold them, so its codes can carry over; a note says so."""
    fmt = options.output_format
    changes = {}
    if options.symmetric is None and options.gguf_type is None:
        changes["symmetric"] = scheme.symmetric
    if options.group_size is None and scheme.group_size in fmt.group_sizes:
        changes["group_size"] = scheme.group_size
    if not changes:
        return options, []
    said = " and ".join(("a symmetric grid" if v else "an asymmetric grid") if k == "symmetric" else f"group size {v}"
                        for k, v in changes.items())
    return dataclasses.replace(options, **changes), [f"the source is {scheme.title}: the output takes {said} from it "
                                                     "so its codes can carry over"]


def _check_one_group(schemes: dict[str, ModuleScheme], group: int, k_dims: dict[str, int],
                     fmt: CheckpointFormat) -> None:
    """InputError where a 4-bit module's group is not the checkpoint's, for a format whose config
    holds one group size (its loaders would read that module with the wrong one)."""
    odd = sorted(m for m, s in schemes.items() if s.bits == 4 and s.group_size != group)
    if not odd:
        return
    four = [k_dims[m] for m, s in schemes.items() if s.bits == 4]
    sizes = [g for g in fmt.group_sizes if all(k % g == 0 for k in four)]
    fix = f"use --group-size {sizes[-1]}" if sizes else "no group size divides every module's input dim"
    first = odd[0]
    raise InputError(f"the {fmt.title} export holds one group size for the whole model, but {first} "
                     f"(K={k_dims[first]}) would be group {schemes[first].group_size}, not {group}; {fix}")


def _fit_to_size(target_bpw: float, reader, structure: ModelStructure, targets: dict[str, str],
                 schemes: dict[str, ModuleScheme], shapes: dict[str, tuple[int, int]], fmt: CheckpointFormat):
    """:func:`.budget.fit_to_size` over the modules not kept, each weight read once as its linear."""
    sized = {m: shapes[m] for m, scheme in schemes.items() if not scheme.kept}
    return fit_to_size(target_bpw, sized, lambda m: structure.as_linear(m, reader.get(targets[m])), fmt)


def _size_note(record: dict) -> str:
    types = ", ".join(f"{n} {kind}" for kind, n in record["types"].items())
    return (f"--target-bpw {record['target_bpw']:g}: {record['planned_bpw']:.3f} bits per weight over the "
            f"quantized modules ({types}), chosen for the least relative squared error")


def _grouped_notes(notes: dict[str, str]) -> list[str]:
    """One line per distinct note of module -> note, naming how many modules and the first."""
    by_note: dict[str, list[str]] = {}
    for module, note in notes.items():
        by_note.setdefault(note, []).append(module)
    return [f"{note} ({modules[0]}" + (f" and {len(modules) - 1} more)" if len(modules) > 1 else ")")
            for note, modules in by_note.items()]


def _check_overrides_match(overrides: tuple[Override, ...], structure: ModelStructure) -> None:
    """InputError for an --override pattern that names no module of the model, with the nearest names."""
    modules = [m for m in (*structure.linears, structure.embedding, structure.head) if m]
    for o in overrides:
        if not any(matches_ignore(m, (o.pattern,)) for m in modules):
            names = {".".join(m.split(".")[i:]) for m in modules for i in range(len(m.split(".")))}
            near = difflib.get_close_matches(o.pattern, sorted(names), n=3, cutoff=0.5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            raise InputError(f"--override {o.pattern}={o.bits}: no module of this model is named {o.pattern} or ends "
                             f"in .{o.pattern}{hint}")


def _base_bits(module: str, structure: ModelStructure, options: QuantizeOptions, config: dict) -> int:
    if module == structure.embedding:
        return options.embedding_bits
    if module == structure.head:
        return options.head_bits
    n_layers = (config.get("text_config") or config).get("num_hidden_layers") or 0
    return recipe_bits(options.recipe, module, False, n_layers)


def _check_schemes(schemes: dict[str, ModuleScheme], fmt: CheckpointFormat) -> None:
    bad = sorted(m for m, scheme in schemes.items() if scheme.bits not in fmt.bits)
    if bad:
        raise InputError(f"the {fmt.name} format stores {'/'.join(map(str, fmt.bits))}-bit modules only, and "
                         f"{bad[0]} would be {schemes[bad[0]].bits}-bit; choose another --format or recipe")


def _format_group(options: QuantizeOptions, fmt: CheckpointFormat) -> QuantizeOptions:
    """A format with one group size gets it for auto; InputError for one it cannot hold."""
    sizes = "/".join(map(str, fmt.group_sizes))
    if options.group_size is not None and options.group_size not in fmt.group_sizes:
        raise InputError(f"--group-size {options.group_size}: {fmt.title} stores one scale per {sizes} weights; "
                         f"use --group-size {fmt.group_sizes[0]}")
    for o in options.overrides:
        if o.group_size is not None and o.group_size not in fmt.group_sizes:
            raise InputError(f"--override {o.pattern}={o.bits}:{o.group_size}: {fmt.title} stores one scale per "
                             f"{sizes} weights")
    if options.group_size is None and len(fmt.group_sizes) == 1:
        return dataclasses.replace(options, group_size=fmt.group_sizes[0])
    return options


def _choose_targets(structure: ModelStructure, infos: dict[str, TensorInfo],
                    options: QuantizeOptions) -> tuple[dict[str, str], set[str], bool]:
    """(output module -> source tensor it is quantized from, source tensors not written, whether
    the output's head stays tied to its table)."""

    def ignored(module: str) -> bool:
        return matches_ignore(module, options.ignore)

    def weight(module: str) -> str:
        name = f"{module}.weight"
        if name not in infos:
            raise InputError(f"checkpoint has no tensor {name}, which the model's structure expects")
        return name

    emb, head = structure.embedding, structure.head
    source_tied = structure.tied and emb is not None and head is not None
    if source_tied and options.untie_head and ignored(head):
        raise InputError(f"--untie-head with {head} ignored would leave the head without weights")
    if not source_tied and head is not None and options.untie_head:
        log.info("the head is already untied; --untie-head changes nothing")
    tied_output = source_tied and not options.untie_head
    quantize_embedding = emb is not None and not options.keep_embedding and not ignored(emb)
    modules = structure.quantized_modules(options.ignore, quantize_embedding, tied_output)
    # an untied head made from a tied table is quantized from the table
    targets = {m: weight(emb if source_tied and m == head else m) for m in modules}
    dropped = {f"{head}.weight"} if source_tied and f"{head}.weight" in infos else set()  # the tied copy
    if not targets:
        raise InputError("nothing to quantize: every linear is ignored")
    return targets, dropped, tied_output


def _check_architecture(model_dir: Path, config: dict, structure: ModelStructure, infos: dict[str, TensorInfo]) -> None:
    """Every tensor the architecture in config.json needs is present with its shape, and nothing else."""
    tied_head = structure.head if structure.tied else None
    model, shapes = build_empty_model(config), {n: i.shape for n, i in infos.items()}
    problems = architecture_mismatches(model, shapes, tied_head)
    if problems and base_model_class(config) and holds_only_the_base_model(model, shapes, structure.head, tied_head):
        named = (config.get("architectures") or [type(model).__name__])[0]
        raise InputError(f"{model_dir}: the tensors are a base model's (no {model.base_model_prefix!r} prefix, "
                         f"no head), but config.json names {named}; set \"architectures\": [\"{base_model_class(config)}\"] in "
                         "config.json to quantize it as the base model it is")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"{model_dir}: the weights do not match config.json: {problems[0]}{more}; "
                         "fix config.json or point --model at the checkpoint it describes")


def _check_dtypes_and_shapes(targets: dict[str, str], infos: dict[str, TensorInfo]) -> None:
    for module, src in targets.items():
        info = infos[src]
        if info.dtype not in FLOAT_DTYPES:
            raise InputError(f"{src} has dtype {info.dtype}; only bf16, fp16 and fp32 weights can be quantized")
        if len(info.shape) != 2:
            raise InputError(f"{src} has shape {list(info.shape)}; a linear weight must be 2-D")


def _check_out_dims(out_dims: dict[str, int], multiple: int) -> None:
    """InputError naming the source tensors whose output dim (tensor -> N) is not a multiple of ``multiple``."""
    bad = {m: n for m, n in out_dims.items() if n % multiple}
    if bad:
        listed = ", ".join(f"{n} (N={v})" for n, v in sorted(bad.items())[:5])
        raise InputError(
            f"the tinygemm kernel needs output dims that are multiples of {multiple}: {listed}; "
            "leave them in bf16 with --ignore"
        )
