"""Plan a quantization: check the checkpoint and the options against each other and decide, for
every tensor, whether it is copied, dropped, or quantized and with which scheme. Reads only
config.json and shard headers, and raises before anything is written."""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import CheckpointReader, TensorInfo, read_config
from .config import CALIBRATED_METHODS, QuantizationConfig, matches_ignore
from .errors import InputError
from .formats import RUNTIME_FORMAT, CheckpointFormat, get_format
from .packing import PACK_N_ALIGN
from .scheme import GROUP_SIZES, ModuleScheme
from .shards import TensorSpec
from .structure import ModelStructure, architecture_mismatches, build_empty_model, inspect_structure

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
AUTO_GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True)
class QuantizeOptions:
    """User choices. ``group_size=None`` means auto."""

    group_size: int | None = None
    symmetric: bool = False
    clip_search: bool = False
    keep_embedding: bool = False
    untie_head: bool = False
    ignore: tuple[str, ...] = ()
    max_shard_bytes: int = 2 * 1000**3
    method: str = "minmax"
    checkpoint_format: str = RUNTIME_FORMAT


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
    notes: tuple[str, ...] = ()  # choices the plan made that the user did not ask for

    @property
    def format(self) -> CheckpointFormat:
        return get_format(self.options.checkpoint_format)

    def scheme_of(self, module: str) -> ModuleScheme:
        return self.qconfig.scheme_for(module)

    def output_config(self) -> dict:
        cfg = copy.deepcopy(self.source_config)
        cfg["quantization_config"] = self.format.quantization_config(self.qconfig)
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
                specs += self.format.tensor_specs(module, info.shape, self.scheme_of(module))
        return specs

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
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "unknown")
        raise InputError(f"{model_dir} is already quantized ({method}); start from a bf16/fp16/fp32 checkpoint")
    reader = CheckpointReader(model_dir)
    structure = inspect_structure(config)
    infos = reader.infos
    _check_architecture(model_dir, config, structure, infos)
    for name, info in infos.items():
        if not isinstance(info.dtype, torch.dtype):
            raise InputError(f"tensor {name} has dtype {info.dtype}, which int4q cannot read")
    options, notes = _implied_options(options, structure)
    targets, dropped, tied_output = _choose_targets(structure, infos, options)
    _check_dtypes_and_shapes(targets, infos)
    emb = structure.embedding
    _check_out_dims({m: s for m, s in targets.items() if m != emb or tied_output}, infos)
    qconfig = QuantizationConfig(
        group_size=_choose_group_size(targets, infos, options.group_size),
        ignore=tuple(options.ignore),
        quantize_embedding=emb in targets,
        method=options.method,
        symmetric=options.symmetric,
        clip_search=options.clip_search,
    )
    return QuantizationPlan(model_dir, reader, config, structure, qconfig, targets, options, frozenset(dropped),
                            tied_output, notes=tuple(notes))


def _implied_options(options: QuantizeOptions, structure: ModelStructure) -> tuple[QuantizeOptions, list[str]]:
    """The options with what the format and the method require, and a note for each change."""
    notes = []
    emb, head = structure.embedding, structure.head
    fmt = get_format(options.checkpoint_format)
    if not fmt.quantizes_embedding and not options.keep_embedding and emb and not matches_ignore(emb, options.ignore):
        options = dataclasses.replace(options, keep_embedding=True)
        notes.append(f"the {fmt.name} format has no quantized vocabulary table: {emb} stays in bf16")
    if options.method in CALIBRATED_METHODS and not options.untie_head and structure.tied and emb and head:
        options = dataclasses.replace(options, untie_head=True)
        notes.append(f"{options.method} quantizes the head on its own inputs: {head} is written untied "
                     "(tie_word_embeddings false)")
    return options, notes


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
    problems = architecture_mismatches(build_empty_model(config), {n: i.shape for n, i in infos.items()}, tied_head)
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


def _check_out_dims(targets: dict[str, str], infos: dict[str, TensorInfo]) -> None:
    bad = {src: infos[src].shape[0] for src in targets.values() if infos[src].shape[0] % PACK_N_ALIGN}
    if bad:
        listed = ", ".join(f"{n} (N={v})" for n, v in sorted(bad.items())[:5])
        raise InputError(
            f"the tinygemm kernel needs output dims that are multiples of {PACK_N_ALIGN}: {listed}; "
            "leave them in bf16 with --ignore"
        )


def _choose_group_size(targets: dict[str, str], infos: dict[str, TensorInfo], requested: int | None) -> int:
    in_dims = {src: infos[src].shape[1] for src in targets.values()}
    working = [g for g in GROUP_SIZES if all(k % g == 0 for k in in_dims.values())]
    if requested is None:
        for g in AUTO_GROUP_SIZES:
            if g in working:
                return g
        raise InputError(
            f"no group size in {AUTO_GROUP_SIZES} divides every input dim ({sorted(set(in_dims.values()))}); "
            "leave the odd tensors in bf16 with --ignore"
        )
    bad = {src: k for src, k in in_dims.items() if k % requested}
    if bad:
        listed = ", ".join(f"{n} (K={k})" for n, k in sorted(bad.items())[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        sizes = ", ".join(map(str, working)) or "none"
        raise InputError(f"group size {requested} does not divide {listed}{more}; sizes that work: {sizes}")
    return requested
