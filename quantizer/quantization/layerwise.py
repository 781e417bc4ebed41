"""The layer-by-layer calibration driver that every calibrated method runs on.

Only the embedding and one decoder layer are ever materialised. The calibration windows go
through the model's own code up to the first decoder layer (so its rotary tables and attention
mask are the model's), then layer by layer: each layer's quantized linears are visited
true-sequentially (the linears that share an input form one step: q/k/v, then o, then gate/up,
then down, inputs re-captured after each step), and the *quantized* layer's outputs feed the
next layer. Finished layers are saved with the hidden states after them, so an interrupted run
can resume. The head is quantized last on the final hidden states; the vocabulary table, which
sees no activations, by round-to-nearest.

A method is a :class:`LayerwiseMethod`: per step the driver feeds the step's input to the
method's accumulator, then asks it to quantize each linear of the step given that accumulator.

Under torchrun each rank holds only its share of the windows and their activations (see
distributed.py): the ranks sum each step's statistic, split the step's linears between them and
broadcast the solved weights; rank 0 alone saves the layers and writes the output.

Peak memory per rank ~ one layer in fp32 + the step's accumulators + two copies of its share of
the calibration activations (nsamples / world_size x seqlen x hidden fp32).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..calibrate import capture
from ..calibrate import state as calib_state
from ..calibrate.capture import Accumulator
from ..calibrate.native_attention import use_causal_kernel
from ..calibrate.output_cache import OutputCache, output_cache_budget
from ..calibrate.ranks import SINGLE, Ranks
from ..calibrate.replay_inputs import ReplayInputs, replay_inputs
from ..calibrate.trace import trace_layer
from ..errors import InputError
from ..io.checkpoint import CheckpointReader
from ..io.shards import ShardWriter, TensorSpec, file_specs
from ..io.structure import build_empty_model, decoder_layers
from ..memory import peak_rss_mb, proc_status_mb
from ..methods.hessian_factor import NotPositiveDefinite
from ..methods.grid import GroupQuantized
from ..schema.methods import UNCALIBRATED
from ..schema.scheme import ModuleScheme
from .carried import quantize_from_source
from .planning import QuantizationPlan
from .report import finish_output, module_entry
from .streamed import quantize_module, refuse_non_finite

Say = Callable[[str], None]
Step = Callable[[str, int, int, str], None]  # (what, done, total, note)
Importance = Callable[[dict[str, tuple[torch.Tensor, int]]], None]


class LayerwiseMethod(Protocol):
    def accumulator(self, in_features: int, device: str = "cpu") -> Accumulator:
        """A fresh statistic of a step's input."""

    def quantize(self, weight: torch.Tensor, stats: Accumulator, scheme: ModuleScheme) -> tuple[GroupQuantized, dict]:
        """One linear's weight [N, K] given its input's statistic: the quantized weight and a report entry."""


def _materialize(module: torch.nn.Module, prefix: str, reader: CheckpointReader, dtype=torch.float32,
                 device: str = "cpu") -> None:
    """Load every parameter of ``module`` (as ``dtype``, on ``device``) from the checkpoint."""
    for name, _ in list(module.named_parameters()):
        capture.set_param(module, name, reader.get(f"{prefix}.{name}").to(device, dtype))


def _materialize_before_layers(model: torch.nn.Module, layers_name: str, plan: QuantizationPlan, device: str,
                               dtype: torch.dtype) -> None:
    """Load, in ``dtype``, every parameter outside the decoder layers and the head that the forward
    up to the first layer may read (GPT-2's position table, say); the head's inputs are loaded later."""
    head = plan.structure.head
    for name, param in list(model.named_parameters()):
        if param.is_meta and not name.startswith(layers_name + ".") and not (head and name.startswith(head + ".")):
            capture.set_param(model, name, plan.reader.get(name).to(device, dtype))


def _buffers_to(model: torch.nn.Module, device: str) -> None:
    """Move the model's materialised buffers (rotary tables) to ``device``."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to(device)


def run_layerwise(plan: QuantizationPlan, out_dir: Path, windows: torch.Tensor, method: LayerwiseMethod,
                  fingerprint: str, resume: bool = False, say: Say | None = None, ranks: Ranks = SINGLE,
                  step: Step | None = None, dtype: torch.dtype = torch.bfloat16,
                  keep_importance: Importance | None = None) -> dict | None:
    """Quantize ``plan`` with ``method`` on the calibration ``windows`` [S, T] into ``out_dir``
    (the partial folder; its state subfolder holds the progress). Each rank runs its own share of
    the windows; rank 0 returns the report, the other ranks None. ``say`` gets messages and
    ``step("layer", done, total, note)`` each finished layer. The layers run in ``dtype`` (bf16
    as the model runs, whose activations every statistic then sums exactly in fp32; or fp32).
    ``keep_importance`` (rank 0) gets every quantized linear's input statistic, the head's under
    the head's name: module -> (column mean squares [K] fp32, input rows)."""
    start = time.perf_counter()
    say = say or (lambda m: None)
    step = step or (lambda *a: None)
    state_dir = out_dir / calib_state.STATE_DIR
    state = calib_state.load_state(state_dir, fingerprint, resume, ranks) if ranks.is_main else {}
    ranks.barrier()  # rank 0 has prepared the state folder
    state_dir.mkdir(parents=True, exist_ok=True)
    done, as_tuple = ranks.broadcast_object((state.get("layers_done"), state.get("as_tuple", False)))
    own = windows[ranks.share(windows.shape[0])]
    model = build_empty_model(plan.source_config)
    if dtype == torch.float32:
        model.float()
    use_causal_kernel(model)
    _buffers_to(model, ranks.device)
    layers_name, layers = decoder_layers(model)
    emb = model.get_input_embeddings()
    _materialize(emb, plan.structure.embedding, plan.reader, torch.bfloat16, ranks.device)  # a lookup: bf16 is exact
    # ...but its output must be in the layers' dtype, from which the model derives its rotary tables' dtype
    emb.register_forward_hook(lambda module, args, out: out.to(dtype))
    _materialize_before_layers(model, layers_name, plan, ranks.device, dtype)

    per_tensor: dict[str, dict] = state.get("tensors", {})
    hidden, kwargs = capture.capture_inputs(model, layers, own, all_samples=done == 0, device=ranks.device)
    capture.release_parameters(emb)  # read again for the head's pass: a large table is not held through the layers
    if done:
        hidden = calib_state.load_hidden(state_dir, done, ranks)
        say(f"resuming after layer {done}/{len(layers)}")
    step("layer", done, len(layers), "")  # starts the clock
    with calib_state.LayerSaves(ranks) as saves:  # each layer's state written behind the next
        for i in range(done, len(layers)):
            layer_start = time.perf_counter()
            prefix = f"{layers_name}.{i}"
            _materialize(layers[i], prefix, plan.reader, dtype, ranks.device)
            importance: dict[str, tuple[torch.Tensor, int]] = {}
            out_tensors, hidden, as_tuple = _calibrate_layer(plan, method, layers[i], prefix, hidden, kwargs,
                                                             per_tensor, ranks, importance)
            for name in plan.reader.infos if ranks.is_main else ():
                if name.startswith(prefix + ".") and name.removesuffix(".weight") not in plan.targets:
                    out_tensors[name] = plan.reader.get(name)
            layers[i].to("meta")
            saves.save(state_dir, fingerprint, i + 1, dict(per_tensor), as_tuple, out_tensors, hidden, ranks,
                       importance)
            step("layer", i + 1, len(layers), f"quantized in {time.perf_counter() - layer_start:.1f} s, "
                 f"peak RSS so far {proc_status_mb('VmHWM'):.0f} MiB")

        head_importance: dict[str, tuple[torch.Tensor, int]] = {}
        head_tensors = _quantize_head(plan, method, model, layers, hidden, own, as_tuple, per_tensor, ranks, say,
                                      head_importance)
    calib_state.remove_hidden(state_dir, len(layers), ranks)
    peaks = ranks.gather_value(peak_rss_mb())  # and every rank is done with the state folder
    if not ranks.is_main:
        return None
    if keep_importance:
        keep_importance({**calib_state.load_importance(state_dir, len(layers)), **head_importance})
    shards = _write_output(plan, out_dir, layers_name, len(layers), _head_target(plan), head_tensors, per_tensor)
    damping_retries = sum(e.get("damp_retries", 0) for e in per_tensor.values())
    return finish_output(plan, out_dir, shards, per_tensor, start, damping_retries=damping_retries,
                         world_size=ranks.world_size, windows_per_rank=ranks.shares(windows.shape[0]),
                         calibration_peak_rss_mb_per_rank=[round(p) for p in peaks])


def _quantize_head(plan, method, model, layers, hidden, own_windows, as_tuple, per_tensor, ranks: Ranks,
                   say: Say, importance: dict) -> dict[str, torch.Tensor]:
    """The head's (or tied table's) tensors, quantized on the final hidden states of every rank's
    windows; solved on rank 0, the only rank that gets them (and its input statistic, into
    ``importance`` under the head's name)."""
    head = _head_target(plan)
    if not head:
        return {}
    say(f"quantizing {head} on the final hidden states")
    acc = capture.head_statistic(model, layers, plan.reader, hidden, own_windows, as_tuple, plan.structure.head,
                                 method, ranks.device, hidden.dtype)
    if ranks.distributed:
        acc.merge(ranks.sum_)
    if not ranks.is_main:
        return {}
    importance[plan.structure.head] = acc.column_mean_square()
    weight = plan.reader.get(plan.targets[head]).to(ranks.device)
    result = _solve(plan, method, head, weight, acc, plan.scheme_of(head))
    return _record(plan, head, weight.shape, *result, per_tensor)


def _solve(plan, method, module: str, weight: torch.Tensor, stats, scheme: ModuleScheme):
    """``method.quantize`` for one module (refused where the weight is not finite); a Hessian no
    damping repairs becomes one line naming the module and the knobs that help."""
    refuse_non_finite(plan, module, weight)
    try:
        return quantize_from_source(plan, module, weight,
                                    lambda: method.quantize(weight, stats, scheme, plan.storage_of(module)))
    except NotPositiveDefinite as e:
        raise InputError(f"GPTQ cannot solve {module}: its Hessian is not positive definite even at damp "
                         f"{e.damp:.3g}; raise --damp, or give more calibration text (--nsamples, --calib)") from None


def _head_target(plan: QuantizationPlan) -> str | None:
    """The module quantized on the head's inputs: the head, or the table when the head is tied to it."""
    head, emb = plan.structure.head, plan.structure.embedding
    if head in plan.targets:
        return head
    return emb if plan.tied_output and emb in plan.targets else None


def _record(plan, module: str, shape, q, stats: dict, per_tensor: dict) -> dict[str, torch.Tensor]:
    """The quantized weight's tensors in the plan's format (on the CPU); records its report entry."""
    tensors = {name: t.cpu() for name, t in plan.format.tensors(module, q, plan.scheme_of(module)).items()}
    per_tensor[module] = module_entry(plan.targets[module], shape, tensors, stats)
    return tensors


def _calibrate_layer(plan, method, layer, prefix: str, hidden, kwargs, per_tensor: dict, ranks: Ranks,
                     importance: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor, bool]:
    """Quantize the layer on the windows' inputs ``hidden``: (its checkpoint tensors on rank 0,
    the quantized layer's outputs for every window, whether the layer returns a tuple). Its
    finished parts are answered from memory (within the budget) and its replay reads the last
    step's inputs: through the module that returns their linear's output, or else where the
    trace shows that this gives its own outputs."""
    first, targets = hidden[:1].to(ranks.device), _layer_targets(plan, prefix)
    trace = trace_layer(layer, first, kwargs, targets)
    with OutputCache(layer, targets, hidden.shape[0], hidden.shape[1], output_cache_budget(hidden),
                     trace.settles, trace.returns) as cache:
        replay = None if trace.steps and cache.answers_through(trace.steps[-1]) else \
            replay_inputs(layer, trace, first, kwargs, hidden.shape[0], cache.reserve)
        out_tensors = _quantize_layer(plan, method, layer, prefix, trace.steps, hidden, kwargs, per_tensor, ranks,
                                      cache, importance, replay)
        outputs, as_tuple = _replay_layer(layer, hidden, kwargs, ranks.device, cache, replay)
    return out_tensors, outputs, as_tuple


def _quantize_layer(plan, method, layer, prefix: str, steps: list[list[str]], hidden, kwargs, per_tensor: dict,
                    ranks: Ranks = SINGLE, cache: OutputCache | None = None, importance: dict | None = None,
                    replay: ReplayInputs | None = None) -> dict[str, torch.Tensor]:
    """Quantize the layer's target linears ``steps`` by step, leaving their dequantized weights in
    place for the later steps; returns their checkpoint tensors (on rank 0) and puts each one's
    input statistic into ``importance``; ``replay`` keeps the last step's inputs. The ranks sum
    each step's statistic, split its linears between them, and share the solved weights."""
    out_tensors: dict[str, torch.Tensor] = {}
    for step in steps:
        keep = cache.keeper(step) if cache is not None else None
        if replay is not None and step is steps[-1]:
            keep = replay.keep
        acc = capture.accumulate(layer, step, hidden, kwargs, method, ranks.device, cache, keep)
        if ranks.distributed:
            acc.merge(ranks.sum_)
        if importance is not None:
            importance.update(dict.fromkeys((f"{prefix}.{name}" for name in step), acc.column_mean_square()))
        linears = [layer.get_submodule(name) for name in step]
        weights = [plan.linear_weight(f"{prefix}.{name}", linear.weight) for name, linear in zip(step, linears)]
        owners = ranks.owner_of([w.numel() for w in weights])
        mine = {name: _solve(plan, method, f"{prefix}.{name}", w, acc, plan.scheme_of(f"{prefix}.{name}"))
                for name, w, owner in zip(step, weights, owners) if owner == ranks.rank}
        del acc
        for name, linear, w, owner in zip(step, linears, weights, owners):
            module = f"{prefix}.{name}"
            q, stats = mine.get(name, (None, None))
            q = ranks.broadcast_dataclass(q, owner)
            stats = ranks.broadcast_object(stats, owner)
            if ranks.is_main:
                out_tensors.update(_record(plan, module, w.shape, q, stats, per_tensor))
            # a transpose is its own inverse; dequantized in fp32 and rounded once to the layer's dtype
            linear.weight.data = plan.linear_weight(module, q.dequantize(linear.weight.dtype))
        if cache is not None:
            cache.finish(step, keep_outputs=replay is None or step is not steps[-2])
    return out_tensors


def _layer_targets(plan: QuantizationPlan, prefix: str) -> set[str]:
    """The names, inside the layer at ``prefix``, of the linears the plan quantizes."""
    return {m[len(prefix) + 1:] for m in plan.targets if m.startswith(prefix + ".")}


def _replay_layer(layer, hidden: torch.Tensor, kwargs: dict, device: str = "cpu", cache: OutputCache | None = None,
                  replay: ReplayInputs | None = None) -> tuple[torch.Tensor, bool]:
    """The (quantized) layer's outputs for every window (kept on the CPU), and whether the layer
    returns a tuple; ``replay``: the last step's inputs, where kept."""
    hidden_out = torch.empty_like(hidden)
    as_tuple = False
    with torch.inference_mode():
        for s in range(hidden.shape[0]):
            if cache is not None:
                cache.window = s
            with replay.substituting(s) if replay is not None else contextlib.nullcontext():
                out = layer(hidden[s:s + 1].to(device), **kwargs)
            as_tuple = isinstance(out, tuple)
            hidden_out[s:s + 1] = capture.hidden_of(out)
    return hidden_out, as_tuple


def _write_output(plan: QuantizationPlan, out_dir: Path, layers_name: str, n_layers: int, head: str | None,
                  head_tensors: dict[str, torch.Tensor], per_tensor: dict) -> list[Path]:
    """The shards: every saved layer, the head (or the tied table), then the tensors outside the
    layers (an untied table quantized by round-to-nearest). Returns the shard paths."""
    state_dir = out_dir / calib_state.STATE_DIR
    reader = plan.reader
    rest = [name for name in sorted(reader.infos)
            if not (name.startswith(layers_name + ".") or name in plan.dropped
                    or (head and name == f"{head}.weight"))]
    specs = [spec for i in range(n_layers) for spec in file_specs(calib_state.layer_file(state_dir, i))]
    specs += [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in head_tensors.items()]
    for name in rest:
        info, module = reader.infos[name], name.removesuffix(".weight")
        specs += (plan.format.tensor_specs(module, plan.weight_shape(module), plan.scheme_of(module))
                  if module in plan.targets
                  else [TensorSpec(name, info.dtype, info.shape)])
    writer = ShardWriter(out_dir, specs, plan.options.max_shard_bytes)
    for i in range(n_layers):
        for name, t in calib_state.read_safetensors(calib_state.layer_file(state_dir, i)).items():
            writer.add(name, t)
    for name, t in head_tensors.items():
        writer.add(name, t)
    for name in rest:
        module, tensor = name.removesuffix(".weight"), reader.get(name)
        if module in plan.targets:
            tensors, entry = quantize_module(plan, module, tensor)
            per_tensor[module] = {**entry, "method": UNCALIBRATED}
            for tname, t in tensors.items():
                writer.add(tname, t)
        else:
            writer.add(name, tensor)
    shards = writer.finish()
    shutil.rmtree(state_dir)
    return shards
