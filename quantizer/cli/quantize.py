"""``int4q quantize`` and ``int4q bundled-model``: options to a request, the core call, one summary line."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..formats import NAMES as FORMAT_NAMES
from ..formats import RUNTIME_FORMAT
from ..formats.gguf.types import GGUF_TYPES
from ..quantization.recipes import RECIPES
from ..schema.methods import METHODS, UNCALIBRATED
from ..schema.methods import NAMES as METHOD_NAMES
from .sections import SectionedCommand


def _size(value: str) -> int:
    from ..errors import InputError
    from ..io.shards import parse_size

    try:
        return parse_size(value)
    except InputError as e:
        raise click.BadParameter(str(e)) from None


def _bits(value: str | None) -> int | None:
    return None if value is None else int(value)


SECTIONS = [
    ("Input and output", ["model", "out", "checkpoint_format", "gguf_type", "target_bpw", "overwrite",
                          "max_shard_size", "base_model", "progress"]),
    ("Precision and recipes", ["group_size", "strict_group_size", "recipe", "embedding_bits", "head_bits",
                               "overrides", "untie_head", "ignore", "symmetric", "clip_search", "keep_embedding"]),
    ("Method and calibration", ["method", "calib", "nsamples", "seqlen", "calib_precision", "seed", "device",
                                "resume", "imatrix_out"]),
    ("GPTQ", ["act_order", "damp", "weighted_grids", "refine"]),
]

EXAMPLES = """
Examples:
  int4q quantize --model models/smollm2-135m-bf16 --out models/smollm2-int4 --group-size 64
  int4q quantize --model Qwen/Qwen2.5-1.5B-Instruct --out qwen-q4_k_m.gguf --format gguf --gguf-type q4_k_m
  int4q quantize --model models/smollm2-135m-bf16 --out smollm2-q4_0.gguf --format gguf --gguf-type q4_0 \\
      --method gptq --refine
  int4q quantize --model models/smollm2-135m-bf16 --out models/smollm2-gptq --format gptq --method gptq
"""


@click.command(cls=SectionedCommand, sections=SECTIONS, epilog=EXAMPLES)
@click.option("--model", "model", required=True, help="bf16/fp16/fp32 model folder or Hub repo id.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              help="Output folder (--format gguf: the .gguf file).")
@click.option(
    "--group-size", default="auto", show_default=True,
    type=click.Choice(["auto", "32", "64", "128", "256"]),
    help="Input columns per scale/zero group; auto = largest of 128/64/32 dividing every input dim (32 for "
         "--format gguf, whose blocks hold 32).",
)
@click.option("--method", default=UNCALIBRATED, show_default=True, type=click.Choice(METHOD_NAMES),
              help="minmax: round-to-nearest on each group's min/max grid; weighted: grids chosen by the error "
                   "weighted by each input column's mean squared activation, then codes moved where that lowers "
                   "the output error on the inputs' correlations within blocks of 64 columns (calibration text, a "
                   "minute for a small model); gptq: GPTQ with calibration text.")
@click.option("--sym/--asym", "symmetric", default=None,
              help="Symmetric grid (zero fixed at 0) or asymmetric min/max grid.  [default: asym; sym for "
                   "--format gptq]")
@click.option("--search", "clip_search", is_flag=True, help="Per-group clipping search minimising squared error.")
@click.option("--strict-group-size", is_flag=True,
              help="Fail when --group-size does not divide a tensor's input dim, instead of falling back to "
                   "the largest smaller group that does (64, then 32; 8-bit when none does).")
@click.option("--recipe", default="all4", show_default=True, type=click.Choice(list(RECIPES)),
              help="Per-module precision: " + "; ".join(f"{k}: {v}" for k, v in RECIPES.items()) + ".")
@click.option("--embedding-bits", type=click.Choice(["4", "5", "6", "8", "16"]),
              help="Bits of the vocabulary table (16 keeps it in bf16; 5 and 6 for --format gguf). Default: the "
                   "recipe's.")
@click.option("--head-bits", type=click.Choice(["4", "5", "6", "8", "16"]),
              help="Bits of the output head (5 and 6 for --format gguf). Default: the table's when they are tied, "
                   "else the recipe's (the K_M --gguf-types: Q6_K, as llama-quantize).")
@click.option("--override", "overrides", multiple=True, metavar="PATTERN=BITS[:GROUP]",
              help="Bits (and group) for modules named PATTERN or ending in .PATTERN, e.g. down_proj=8, "
                   "lm_head=4:32, mlp.up_proj=16 (5 and 6 for --format gguf); repeatable, the last match wins.")
@click.option("--keep-embedding", is_flag=True, hidden=True, help="The same as --embedding-bits 16.")
@click.option("--untie-head", is_flag=True, help="Write a separately quantized lm_head; sets tie_word_embeddings false.")
@click.option("--ignore", multiple=True, help="Module name (or suffix) to leave unquantized; repeatable.")
@click.option("--max-shard-size", default="2GB", show_default=True, callback=lambda ctx, param, value: _size(value),
              help="Largest output shard, e.g. 2GB, 500MB.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
@click.option("--base-model", metavar="OWNER/NAME",
              help="The source's Hub id for the model card, when --model is a local folder whose config "
                   "does not name it.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show progress on stderr.")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="[gptq] Calibration text (plain, or .jsonl with a 'text' field). Default: the calibration "
                   "half of CPython's pydoc_data.topics (verify evaluates on the other half).")
@click.option("--nsamples", type=click.IntRange(1, 100_000),
              help="[gptq, weighted] Calibration windows. Default: " + ", ".join(
                  f"{m.default_nsamples} for {m.name}" for m in METHODS.values() if m.calibrated) + ".")
@click.option("--seqlen", default=512, show_default=True, type=click.IntRange(8, 100_000),
              help="[gptq, weighted] Tokens per calibration window.")
@click.option("--calib-precision", default="auto", show_default=True, type=click.Choice(["auto", "bf16", "fp32"]),
              help="[gptq, weighted] What the layers run the calibration windows in: bf16, as the model runs "
                   "(its activations are summed exactly into fp32 statistics), or fp32; auto: bf16 on a GPU or "
                   "a CPU with bf16 dot products (AVX-512 BF16, AMX, Arm BF16), where it is the faster, else fp32.")
@click.option("--act-order/--no-act-order", default=True, show_default=True,
              help="[gptq] Visit columns by decreasing Hessian diagonal (groups stay static: no g_idx).")
@click.option("--damp", default=0.01, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="[gptq] Dampening, as a fraction of the mean Hessian diagonal.")
@click.option("--weighted-grids/--minmax-grids", default=True, show_default=True,
              help="[gptq] Each group's grid by the search weighted by diag(H) before the solve, or its min/max.")
@click.option("--refine", is_flag=True,
              help="[gptq] After each solve, coordinate descent on the full objective: codes one step up or down "
                   "and each group's scale refit, on symmetric grids (--sym, --gguf-type q4_0/q5_0); slower, "
                   "lower error.")
@click.option("--seed", default=0, show_default=True, type=int, help="[gptq, weighted] Seed for the calibration windows.")
@click.option("--resume", is_flag=True, help="[gptq] Continue an interrupted run from its last finished layer.")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="[gptq, weighted] Where the calibration forward passes and solves run. Under torchrun every "
                   "rank takes a share of the windows (gloo on cpu, NCCL on cuda).")
@click.option("--format", "checkpoint_format", default=RUNTIME_FORMAT, show_default=True,
              type=click.Choice(FORMAT_NAMES),
              help="cpu_int4 (this runtime, verify, push); the GPTQ v1 layout (qweight/qzeros/scales/"
                   "g_idx) for vLLM's W4A8 CPU path and GPTQ loaders, the embedding then bf16; AWQ's layout (the "
                   "asymmetric grid vLLM's CPU backend runs); or one .gguf file for llama.cpp, Ollama and LM Studio, "
                   "written by llama.cpp's own converter.")
@click.option("--gguf-type", type=click.Choice(list(GGUF_TYPES)),
              help="[gguf] llama.cpp's file type: q4_0 and q5_0 (symmetric; calibrated, the first eighth of ffn_down "
                   "Q4_1/Q5_1, as llama-quantize with an importance matrix), q4_1 (the default) and q5_1; q4_k, "
                   "q5_k, q6_k (every module in 256-weight super-blocks, like llama-quantize --pure); q4_k_m, q5_k_m "
                   "(llama-quantize's mixtures: Q6_K for the head and for attn_v and ffn_down in its chosen layers); "
                   "iq4_nl, iq4_xs (4-bit codes on llama.cpp's non-linear table; its mixtures: Q6_K for the head, "
                   "Q5_K for attn_v of grouped-query models and, uncalibrated, the first eighth of ffn_down). "
                   "Rows 256 does not divide fall back as llama-quantize does (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to "
                   "Q8_0, IQ4_XS to IQ4_NL); 8-bit modules are Q8_0, kept ones as llama.cpp's converter writes them.")
@click.option("--target-bpw", type=float, metavar="BITS",
              help="[gguf] Choose each tensor's type (IQ4_XS, Q4_K, Q5_K, Q6_K, Q8_0, or their fallbacks) for this "
                   "many bits per weight over the quantized tensors, with the least total relative error measured "
                   "per type (every weight is read once more to measure it). Instead of --gguf-type.")
@click.option("--imatrix-out", type=click.Path(path_type=Path, dir_okay=False),
              help="[gptq, weighted] Also write the calibration's per-column mean squared activations as llama.cpp's "
                   "importance-matrix file (.gguf, as llama-imatrix writes it), for llama-quantize --imatrix. "
                   "Any --format; needs llama.cpp's converter for the tensor names.")
def quantize(model, out, group_size, method, symmetric, clip_search, strict_group_size, recipe, embedding_bits,
             head_bits, overrides, keep_embedding, untie_head, ignore, max_shard_size, overwrite, base_model, progress,
             calib, nsamples, seqlen, calib_precision, act_order, damp, weighted_grids, refine, seed, resume, device,
             checkpoint_format, gguf_type, target_bpw, imatrix_out):
    """Quantize a checkpoint into cpu_int4, a GPTQ/AWQ export or a GGUF file, streaming one tensor
    (calibrated methods: one layer) at a time."""
    from .. import api
    from ..memory import peak_rss_mb

    if keep_embedding:
        if embedding_bits not in (None, "16"):
            raise click.UsageError(f"--keep-embedding is --embedding-bits 16; drop one of it and --embedding-bits "
                                   f"{embedding_bits}")
        embedding_bits = "16"
    start = time.perf_counter()
    shown = _ShownProgress(progress)
    try:
        report = api.quantize(
            model, out, format=checkpoint_format, method=method, group_size=group_size, gguf_type=gguf_type,
            target_bpw=target_bpw,
            symmetric=symmetric, recipe=recipe, embedding_bits=_bits(embedding_bits), head_bits=_bits(head_bits),
            overrides=overrides, ignore=ignore, untie_head=untie_head, clip_search=clip_search,
            strict_group_size=strict_group_size, max_shard_size=max_shard_size, overwrite=overwrite,
            base_model=base_model, calib=calib, nsamples=nsamples, seqlen=seqlen, seed=seed,
            calib_precision=calib_precision, device=device, act_order=act_order, damp=damp,
            weighted_grids=weighted_grids, refine=refine, resume=resume, imatrix_out=imatrix_out, progress=shown)
    finally:
        shown.close()
    if report is None:
        return
    s = report.summary
    click.echo(
        f"quantized {s.tensors_quantized} tensors at group {report.quantization_config['group_size']}: "
        f"{s.bits_per_weight} bits/weight ({s.whole_model_bits_per_weight} for the whole model), "
        f"min SNR {s.snr_db_min} dB, {len(report.fallbacks)} group fallbacks, "
        f"{s.source_bytes / 1e6:.1f} MB -> {s.output_bytes / 1e6:.1f} MB in "
        f"{time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mb():.0f} MiB -> {out}"
    )
    if s.source_grids:
        click.echo(source_grids_line(report))
    if imatrix_out:
        click.echo(f"the calibration's importance matrix, for llama-quantize --imatrix -> {imatrix_out}")


def source_grids_line(report) -> str:
    """One line on what became of a quantized source's grids, with the largest error against its
    values of a module that did not carry over exactly."""
    counts = report.summary.source_grids
    inexact = [e["max_abs_err"] for e in report.tensors.values() if e.get("source_grid") in ("nearest", "rounded")]
    worst = f"; largest error of the others against the source's values {max(inexact):.3g}" if inexact else ""
    return (f"the source's grids: of its {sum(counts.values())} quantized modules {counts['exact']} carried over "
            f"exactly, {counts['nearest']} to the nearest stored scale and zero, {counts['rounded']} rounded again"
            f"{worst} (per module in the report)")


class _ShownProgress:
    """Progress on stderr (only with ``enabled``; notes always): bars with rate and ETA on a
    terminal, plain lines otherwise (see cli_progress)."""

    def __init__(self, enabled: bool):
        from .progress import StepReporter

        self.enabled, self.bytes, self.steps = enabled, None, StepReporter(enabled, unit="layer")

    def start(self, total_bytes: int) -> None:
        from .progress import Steps

        self.bytes = Steps("quantize", total_bytes, unit="B", enabled=self.enabled)

    def advance(self, nbytes: int) -> None:
        self.bytes.update(self.bytes.done + nbytes)

    def step(self, what: str, done: int, total: int, note: str = "") -> None:
        self.steps(what, done, total, note)

    def wrote(self, what: str, done: int, total: int) -> None:
        self.steps(what, done, total, unit="B")

    def say(self, message: str) -> None:
        if self.enabled:
            click.echo(f"int4q: {message}", err=True)

    def note(self, message: str) -> None:
        click.echo(f"int4q: note: {message}", err=True)

    def close(self) -> None:
        if self.bytes is not None:
            self.bytes.close()
        self.steps.close()


@click.command("bundled-model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def bundled_model(out, overwrite):
    """Write the bundled SmolLM2-135M-Instruct as a bf16 checkpoint to OUT."""
    from ..io.bundled import build_default_model, is_bundled_output

    if Path(out).exists() and not overwrite:
        if not is_bundled_output(out):
            raise click.UsageError(f"{out} exists and is not the bundled model; choose another folder")
        click.echo(f"{out} already holds the bundled model; keeping it")
        return
    build_default_model(out, overwrite=overwrite)
    click.echo(f"wrote SmolLM2-135M-Instruct (bf16) -> {out}")
