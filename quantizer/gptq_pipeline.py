"""GPTQ over a whole checkpoint, streamed one decoder layer at a time.

Only the embedding and one decoder layer are ever materialised. The calibration windows go
through the model's own code up to the first decoder layer (so its rotary tables and attention
mask are the model's), then layer by layer: each layer's linears are quantized true-sequentially
(the linears that share an input form one step: q/k/v, then o, then gate/up, then down, inputs
re-captured after each step), and the *quantized* layer's outputs feed the next layer. Finished
layers are saved with the hidden states after them, so an interrupted run can resume.

Peak memory ~ one layer in fp32 + its step's Hessians (K x K fp32 each) + two copies of the
calibration activations (nsamples x seqlen x hidden fp32).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .calibration import calibration_windows
from .checkpoint import CheckpointReader, copy_aux_files, proc_status_mb, release_free_memory, write_json
from .shards import ShardWriter, TensorSpec, file_specs, write_safetensors
from .errors import InputError
from .gptq_format import gptq_quantization_config, gptq_tensors
from .gptq import ROW_CHUNK, HessianAccumulator, gptq_quantize, proxy_loss
from .minmax import ErrorStats, GroupQuantized, quantize_groupwise
from .pipeline import REPORT_NAME, QuantizationPlan, build_report, cpu_int4_specs, quantize_rtn
from .structure import build_empty_model, decoder_layers

log = logging.getLogger(__name__)
STATE_DIR = ".gptq-state"


@dataclass(frozen=True)
class GptqOptions:
    nsamples: int = 128
    seqlen: int = 512
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    seed: int = 0
    checkpoint_format: str = "cpu_int4"  # or "gptq": the GPTQ v1 layout (integer zero points, fp16 scales)


class _Stop(Exception):
    """Raised from a hook to end a forward pass once the wanted inputs are captured."""


def _set_param(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


def _materialize(module: torch.nn.Module, prefix: str, reader: CheckpointReader, dtype=torch.float32) -> None:
    """Load every parameter of ``module`` (as ``dtype``) from the checkpoint."""
    for name, _ in list(module.named_parameters()):
        _set_param(module, name, reader.get(f"{prefix}.{name}").to(dtype))


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


class _Replay(torch.nn.Module):
    """Stands in for a decoder layer: the first returns stored hidden states, the rest pass through."""

    def __init__(self, stored: torch.Tensor | None, as_tuple: bool):
        super().__init__()
        self.stored, self.as_tuple, self.index = stored, as_tuple, 0

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states if self.stored is None else self.stored[self.index:self.index + 1]
        return (out,) if self.as_tuple else out


def fingerprint(plan: QuantizationPlan, options: GptqOptions, windows: torch.Tensor) -> str:
    """Identifies inputs and settings; a partial run resumes only under the same fingerprint."""
    h = hashlib.sha256()
    h.update(json.dumps(plan.source_config, sort_keys=True).encode())
    for f in plan.reader.files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(plan.qconfig.to_dict(), sort_keys=True).encode())
    h.update(json.dumps(dataclasses.asdict(options), sort_keys=True).encode())
    h.update(json.dumps(plan.targets, sort_keys=True).encode())
    h.update(windows.numpy().tobytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def _steps(layer: torch.nn.Module, x: torch.Tensor, kwargs: dict, wanted: set[str]) -> list[list[str]]:
    """The layer's quantized linears in call order, grouped into steps of linears that receive
    the very same input tensor (identity, not address: a freed input's address can be reused)."""
    calls: list[tuple[str, torch.Tensor]] = []  # holding the inputs keeps them alive and distinct
    hooks = [m.register_forward_pre_hook(lambda m, a, n=name: calls.append((n, a[0])))
             for name, m in layer.named_modules() if name in wanted]
    try:
        with torch.inference_mode():
            layer(x, **kwargs)
    finally:
        for hk in hooks:
            hk.remove()
    steps: list[list[str]] = []
    last_input = None
    for name, inp in calls:
        if steps and inp is last_input and name not in steps[-1]:
            steps[-1].append(name)
        elif not any(name in s for s in steps):
            steps.append([name])
        last_input = inp
    return steps


def run_gptq(plan: QuantizationPlan, out_dir: Path, tokenizer, calib_text: str, calib_origin: str,
             options: GptqOptions, resume: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Quantize ``plan`` with GPTQ into ``out_dir`` (the partial folder). Returns the report."""
    start = time.perf_counter()
    say = progress or (lambda m: None)
    q = dataclasses.replace(plan.qconfig, calibration={
        "text": calib_origin, "nsamples": options.nsamples, "seqlen": options.seqlen, "seed": options.seed,
        "act_order": options.act_order, "damp": options.damp})
    plan = dataclasses.replace(plan, qconfig=q)
    reader = plan.reader
    windows = calibration_windows(tokenizer, calib_text, options.nsamples, options.seqlen, options.seed)
    state_dir = out_dir / STATE_DIR
    fp = fingerprint(plan, options, windows)
    state = _load_state(state_dir, fp, resume)

    model = build_empty_model(plan.source_config).float()
    layers_name, layers = decoder_layers(model)
    emb = model.get_input_embeddings()
    emb_name = plan.structure.embedding
    head_name = plan.structure.head
    _materialize(emb, emb_name, reader, torch.bfloat16)  # a lookup: bf16 is exact, fp32 would double it
    # ...but its output must be fp32, or the model derives bf16 rotary tables from its dtype
    emb.register_forward_hook(lambda module, args, out: out.float())

    per_tensor: dict[str, dict] = state["tensors"]
    done = state["layers_done"]
    as_tuple = state.get("as_tuple", False)
    hidden, kwargs = _capture_inputs(model, layers, windows, all_samples=done == 0)
    if done:
        hidden = _read_safetensors(_hidden_file(state_dir, done))["hidden"]
        say(f"resuming after layer {done}/{len(layers)}")
    for i in range(done, len(layers)):
        prefix = f"{layers_name}.{i}"
        layer = layers[i]
        _materialize(layer, prefix, reader)
        wanted = {m[len(prefix) + 1:] for m in plan.targets if m.startswith(prefix + ".")}
        layer_start = time.perf_counter()
        out_tensors: dict[str, torch.Tensor] = {}
        for step in _steps(layer, hidden[:1], kwargs, wanted):
            H = _accumulate(layer, step, hidden, kwargs)
            for name in step:
                linear = layer.get_submodule(name)
                full = f"{prefix}.{name}"
                gq, stats = _quantize_linear(linear.weight, H, q, options)
                per_tensor[full] = {"source": plan.targets[full], "shape": list(linear.weight.shape), **stats}
                out_tensors.update(_tensors_of(full, gq, options))
                linear.weight.data = gq.dequantize()
            del H
        hidden_out = torch.empty_like(hidden)
        with torch.inference_mode():
            for s in range(hidden.shape[0]):
                out = layer(hidden[s:s + 1], **kwargs)
                as_tuple = isinstance(out, tuple)
                hidden_out[s:s + 1] = _hidden(out)
        hidden = hidden_out
        for name in reader.infos:
            if name.startswith(prefix + ".") and name.removesuffix(".weight") not in plan.targets:
                out_tensors[name] = reader.get(name)
        layer.to("meta")
        _save_state(state_dir, fp, i + 1, per_tensor, as_tuple, out_tensors, hidden)
        release_free_memory()
        say(f"layer {i + 1}/{len(layers)} quantized in {time.perf_counter() - layer_start:.1f} s "
            f"(peak RSS so far {proc_status_mb('VmHWM'):.0f} MiB)")

    head_tensors: dict[str, torch.Tensor] = {}
    if head_name in plan.targets:
        say("quantizing the head on the final hidden states")
        H = _head_hessian(model, layers, reader, hidden, windows, as_tuple, head_name)
        W = reader.get(plan.targets[head_name])
        gq, stats = _quantize_linear(W, H, q, options)
        per_tensor[head_name] = {"source": plan.targets[head_name], "shape": list(W.shape), **stats}
        head_tensors = _tensors_of(head_name, gq, options)
        del H, W, gq
    layer_prefix = layers_name + "."
    head_done = head_name in plan.targets
    rest = [name for name in sorted(reader.infos)
            if not (name.startswith(layer_prefix) or name in plan.dropped
                    or (head_done and name.removesuffix(".weight") == head_name))]
    specs = [spec for i in range(len(layers)) for spec in file_specs(_layer_file(state_dir, i))]
    specs += [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in head_tensors.items()]
    for name in rest:
        info, module = reader.infos[name], name.removesuffix(".weight")
        specs += (cpu_int4_specs(module, info.shape, q.group_size) if module in plan.targets
                  else [TensorSpec(name, info.dtype, info.shape)])
    writer = ShardWriter(out_dir, specs, plan.options.max_shard_bytes)
    for i in range(len(layers)):
        for name, t in _read_safetensors(_layer_file(state_dir, i)).items():
            writer.add(name, t)
    for name, t in head_tensors.items():
        writer.add(name, t)
    for name in rest:
        module = name.removesuffix(".weight")
        tensor = reader.get(name)
        if module in plan.targets:  # the vocabulary table: round-to-nearest
            tensors, stats = quantize_rtn(tensor, q)
            per_tensor[module] = {"source": name, "shape": list(tensor.shape), **stats.as_dict(), "method": "minmax"}
            for suffix, t in tensors.items():
                writer.add(f"{module}.{suffix}", t)
        else:
            writer.add(name, tensor)
    gptq_format = options.checkpoint_format == "gptq"
    quantized_params = quantized_bytes = 0
    for module, entry in per_tensor.items():
        n, k = entry["shape"]
        quantized_params += n * k
        # packed codes, then per group: bf16 scale + zero, or fp16 scale + a 4-bit zero point
        quantized_bytes += n * k // 2 + (n * (k // q.group_size) * (2.5 if gptq_format else 4))
    shards = writer.finish()
    shutil.rmtree(state_dir)
    copy_aux_files(plan.model_dir, out_dir)
    config = plan.output_config()
    if gptq_format:
        config["quantization_config"] = gptq_quantization_config(q.group_size, q.symmetric)
    write_json(out_dir / "config.json", config)
    report = build_report(plan, per_tensor, quantized_params, quantized_bytes, shards)
    report["summary"]["seconds"] = round(time.perf_counter() - start, 3)
    report["summary"]["damping_retries"] = sum(e.get("damp_retries", 0) for e in per_tensor.values())
    write_json(out_dir / REPORT_NAME, report)
    return report


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _capture_inputs(model, layers, windows: torch.Tensor, all_samples: bool):
    """Run the model's own forward up to the first decoder layer. Returns (hidden states
    [S, T, H] fp32 of every window, or None when not ``all_samples``; the layer's keyword
    arguments for one window, which are the same for every window of that length)."""
    captured: dict = {}

    def hook(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    hidden = None
    try:
        count = windows.shape[0] if all_samples else 1
        for s in range(count):
            try:
                with torch.inference_mode():
                    model(input_ids=windows[s:s + 1], use_cache=False)
            except _Stop:
                pass
            if hidden is None:
                hidden = torch.empty(count, *captured["hidden"].shape[1:], dtype=torch.float32)
            hidden[s] = captured["hidden"][0].float()
    finally:
        handle.remove()
    return (hidden if all_samples else None), captured["kwargs"]


def _accumulate(layer, step: list[str], hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The Hessian of the step's shared input over every window (each forward stops as soon as
    the step's first linear has its input)."""
    acc = HessianAccumulator(layer.get_submodule(step[0]).in_features)

    def hook(module, args):
        acc.add(args[0])
        raise _Stop

    handles = [layer.get_submodule(step[0]).register_forward_pre_hook(hook)]
    try:
        with torch.inference_mode():
            for s in range(hidden.shape[0]):
                try:
                    layer(hidden[s:s + 1], **kwargs)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    return acc.H


def _quantize_linear(W: torch.Tensor, H: torch.Tensor, q, options: GptqOptions) -> tuple[GroupQuantized, dict]:
    """GPTQ one weight; the stats compare it with round-to-nearest on the same objective."""
    gq, info = gptq_quantize(W, H, q.group_size, symmetric=q.symmetric, act_order=options.act_order,
                             damp=options.damp, block_size=options.block_size,
                             integer_zero=options.checkpoint_format == "gptq")
    err, gptq_loss, rtn_loss = ErrorStats(), 0.0, 0.0
    for start in range(0, W.shape[0], ROW_CHUNK):  # row chunks bound the fp32 copies of a large head
        rows = slice(start, start + ROW_CHUNK)
        w = W[rows]
        deq = GroupQuantized(gq.codes[rows], gq.scale[rows], gq.zero[rows]).dequantize()
        err.add(w, deq)
        gptq_loss += proxy_loss(w, deq, H)
        rtn_loss += proxy_loss(w, quantize_groupwise(w, q.group_size, symmetric=q.symmetric).dequantize(), H)
    return gq, {
        **err.as_dict(), "method": "gptq", "gptq_loss": gptq_loss, "rtn_loss": rtn_loss,
        "damp": info.damp, "damp_retries": info.retries, "dead_columns": info.dead_columns,
    }


def _tensors_of(module: str, gq: GroupQuantized, options: GptqOptions) -> dict[str, torch.Tensor]:
    if options.checkpoint_format == "gptq":
        return gptq_tensors(module, gq)
    return {f"{module}.{suffix}": t for suffix, t in gq.checkpoint_tensors().items()}


def _head_hessian(model, layers, reader, hidden, windows, as_tuple, head_name) -> torch.Tensor:
    """H of the head's inputs (the final norm's outputs), through the model's own code: the
    decoder layers are replaced by a replay of the final hidden states."""
    replay = _Replay(hidden, as_tuple)
    originals = list(layers)
    for i in range(len(layers)):
        layers[i] = replay if i == 0 else _Replay(None, as_tuple)
    head = model.get_output_embeddings()
    for name, p in list(model.named_parameters()):
        if p.is_meta and not name.startswith(head_name + "."):
            _set_param(model, name, reader.get(name).to(torch.float32))
    acc = HessianAccumulator(head.in_features)

    def hook(module, args):
        acc.add(args[0])
        raise _Stop

    handle = head.register_forward_pre_hook(hook)
    try:
        with torch.inference_mode():
            for s in range(windows.shape[0]):
                replay.index = s
                try:
                    model(input_ids=windows[s:s + 1], use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
        for i, layer in enumerate(originals):
            layers[i] = layer
    return acc.H


def _hidden_file(state_dir: Path, layers_done: int) -> Path:
    """The hidden states after the first ``layers_done`` layers: named by that count, so a state
    can only ever be paired with the activations it was saved with."""
    return state_dir / f"hidden-{layers_done:05d}.safetensors"


def _layer_file(state_dir: Path, index: int) -> Path:
    return state_dir / f"layer-{index:05d}.safetensors"


def _load_state(state_dir: Path, fp: str, resume: bool) -> dict:
    """The saved progress of an earlier run with the same fingerprint (with ``resume``), else a fresh start."""
    fresh = {"layers_done": 0, "tensors": {}}
    path = state_dir / "state.json"
    if not resume or not path.is_file():
        if resume:
            log.warning("nothing to resume; starting from the first layer")
        shutil.rmtree(state_dir, ignore_errors=True)
        state_dir.mkdir(parents=True)
        return fresh
    restart = "rerun without --resume to start over"
    try:
        state = json.loads(path.read_text())
        done = int(state["layers_done"])
    except (ValueError, KeyError, TypeError):
        raise InputError(f"{path} is corrupt; {restart}") from None
    if state.get("fingerprint") != fp:
        raise InputError(f"the interrupted run was made with different inputs or settings; {restart}")
    needed = [_layer_file(state_dir, i) for i in range(done)] + ([_hidden_file(state_dir, done)] if done else [])
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise InputError(f"the saved state in {state_dir} is incomplete (no {missing[0]}); {restart}")
    return state


def _save_state(state_dir: Path, fp: str, layers_done: int, per_tensor: dict, as_tuple: bool,
                layer_tensors: dict[str, torch.Tensor], hidden: torch.Tensor) -> None:
    """Persist one finished layer: its tensors and the hidden states after it (each under a name
    of its own), then the state that says it is done, each written to a temporary name and
    renamed; only then the previous layer's hidden states go."""
    for path, tensors in ((_layer_file(state_dir, layers_done - 1), layer_tensors),
                          (_hidden_file(state_dir, layers_done), {"hidden": hidden})):
        tmp = path.with_name(path.name + ".tmp")
        write_safetensors(tmp, tensors)
        tmp.replace(path)
    tmp = state_dir / "state.json.tmp"
    tmp.write_text(json.dumps({"fingerprint": fp, "layers_done": layers_done, "tensors": per_tensor,
                               "as_tuple": as_tuple}))
    tmp.replace(state_dir / "state.json")
    _hidden_file(state_dir, layers_done - 1).unlink(missing_ok=True)
