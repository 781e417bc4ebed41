"""The ``int4q`` command line: parse options, show progress, turn errors into one line and an
exit code. No quantization logic lives here."""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import click

from .config import CALIBRATED_METHODS, DEFAULT_NSAMPLES, METHODS
from .errors import Int4qError
from .formats import NAMES as FORMAT_NAMES
from .formats import RUNTIME_FORMAT
from .recipes import RECIPES


class Int4qGroup(click.Group):
    """Maps library errors to one line on stderr and exit 1; never prints a traceback unless
    INT4Q_DEBUG=1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BaseException as e:
            _close_progress_bars()  # so the message starts a line of its own
            if isinstance(e, (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit)):
                raise
            self._exit_for(e)

    @staticmethod
    def _exit_for(e: BaseException):
        kept = getattr(e, "int4q_kept", "")
        if isinstance(e, Int4qError):
            raise click.ClickException(_rank_prefix(e) + str(e) + kept) from None
        if isinstance(e, KeyboardInterrupt):
            click.echo("int4q: interrupted" + kept, err=True)
            sys.exit(130)
        if isinstance(e, MemoryError):
            raise click.ClickException("out of memory" + kept) from None
        if isinstance(e, OSError) and e.errno in OS_ERRORS:
            where = e.filename or "the output"
            raise click.ClickException(OS_ERRORS[e.errno].format(where=where) + kept) from None
        # An unexpected failure: still one line, with a way to see more.
        if os.environ.get("INT4Q_DEBUG") == "1":
            traceback.print_exc()
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise click.ClickException(
            f"{_rank_prefix(e)}internal error: {type(e).__name__}: {first} (set INT4Q_DEBUG=1 for the traceback)" + kept
        ) from None


OS_ERRORS = {
    errno.ENOSPC: "no space left on the device while writing {where}; free space or choose another --out",
    errno.EDQUOT: "disk quota exceeded while writing {where}; free space or choose another --out",
    errno.EACCES: "permission denied: {where}; choose a folder you can write to",
    errno.EPERM: "operation not permitted: {where}; choose a folder you can write to",
    errno.EROFS: "read-only file system: {where}; choose a writable folder",
}


def _rank_prefix(e: BaseException) -> str:
    """Under torchrun every rank's error says which rank it is (a lost peer's already does)."""
    from .distributed import RankLost, in_launcher

    if not in_launcher() or isinstance(e, RankLost):
        return ""
    return f"rank {os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']}: "


def _close_progress_bars() -> None:
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


@click.group(cls=Int4qGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
@click.version_option(package_name="int4q")
def main(verbose: bool) -> None:
    """int4q: 4-bit group-wise checkpoints for CPU inference."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="int4q: %(message)s")


def _group_size(value: str) -> int | None:
    return None if value == "auto" else int(value)


def _bits(value: str | None) -> int | None:
    return None if value is None else int(value)


@main.command()
@click.option("--model", "model", required=True, help="bf16/fp16/fp32 model folder or Hub repo id.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Output folder.")
@click.option(
    "--group-size", default="auto", show_default=True,
    type=click.Choice(["auto", "32", "64", "128", "256"]),
    help="Input columns per scale/zero group; auto = largest of 128/64/32 dividing every input dim.",
)
@click.option("--method", default="minmax", show_default=True, type=click.Choice(METHODS),
              help="minmax: round-to-nearest on each group's min/max grid; weighted: round-to-nearest on grids "
                   "chosen by the error weighted by each input column's mean squared activation (calibration "
                   "text); gptq: GPTQ with calibration text.")
@click.option("--sym/--asym", "symmetric", default=None,
              help="Symmetric grid (zero fixed at 0) or asymmetric min/max grid.  [default: asym; sym for "
                   "--format gptq]")
@click.option("--search", "clip_search", is_flag=True, help="Per-group clipping search minimising squared error.")
@click.option("--strict-group-size", is_flag=True,
              help="Fail when --group-size does not divide a tensor's input dim, instead of falling back to "
                   "the largest smaller group that does (64, then 32; 8-bit when none does).")
@click.option("--recipe", default="all4", show_default=True, type=click.Choice(list(RECIPES)),
              help="Per-module precision: " + "; ".join(f"{k}: {v}" for k, v in RECIPES.items()) + ".")
@click.option("--embedding-bits", type=click.Choice(["4", "8", "16"]),
              help="Bits of the vocabulary table (16 keeps it in bf16). Default: the recipe's.")
@click.option("--head-bits", type=click.Choice(["4", "8", "16"]),
              help="Bits of the output head. Default: the table's when they are tied, else the recipe's.")
@click.option("--override", "overrides", multiple=True, metavar="PATTERN=BITS[:GROUP]",
              help="Bits (and group) for modules named PATTERN or ending in .PATTERN, e.g. down_proj=8, "
                   "lm_head=4:32, mlp.up_proj=16; repeatable, the last match wins.")
@click.option("--keep-embedding", is_flag=True, help="Leave the vocabulary table in bf16 (--embedding-bits 16).")
@click.option("--untie-head", is_flag=True, help="Write a separately quantized lm_head; sets tie_word_embeddings false.")
@click.option("--ignore", multiple=True, help="Module name (or suffix) to leave unquantized; repeatable.")
@click.option("--max-shard-size", default="2GB", show_default=True, help="Largest output shard, e.g. 2GB, 500MB.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
@click.option("--base-model", metavar="OWNER/NAME",
              help="The source's Hub id for the model card, when --model is a local folder whose config "
                   "does not name it.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show progress on stderr.")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="[gptq] Calibration text (plain, or .jsonl with a 'text' field). Default: the calibration "
                   "half of CPython's pydoc_data.topics (verify evaluates on the other half).")
@click.option("--nsamples", type=click.IntRange(1, 100_000),
              help="[gptq, weighted] Calibration windows. Default: 128 for gptq, 16 for weighted.")
@click.option("--seqlen", default=512, show_default=True, type=click.IntRange(8, 100_000),
              help="[gptq, weighted] Tokens per calibration window.")
@click.option("--act-order/--no-act-order", default=True, show_default=True,
              help="[gptq] Visit columns by decreasing Hessian diagonal (groups stay static: no g_idx).")
@click.option("--damp", default=0.01, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="[gptq] Dampening, as a fraction of the mean Hessian diagonal.")
@click.option("--weighted-grids/--minmax-grids", default=True, show_default=True,
              help="[gptq] Each group's grid by the search weighted by diag(H) before the solve, or its min/max.")
@click.option("--seed", default=0, show_default=True, type=int, help="[gptq, weighted] Seed for the calibration windows.")
@click.option("--resume", is_flag=True, help="[gptq] Continue an interrupted run from its last finished layer.")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="[gptq, weighted] Where the calibration forward passes and solves run. Under torchrun every "
                   "rank takes a share of the windows (gloo on cpu, NCCL on cuda).")
@click.option("--format", "checkpoint_format", default=RUNTIME_FORMAT, show_default=True,
              type=click.Choice(FORMAT_NAMES),
              help="cpu_int4 (this runtime, verify, push) or the GPTQ v1 layout (qweight/qzeros/scales/"
                   "g_idx) for vLLM's W4A8 CPU path and GPTQ loaders; the embedding then stays bf16.")
def quantize(model, out, group_size, method, symmetric, clip_search, strict_group_size, recipe, embedding_bits,
             head_bits, overrides, keep_embedding, untie_head, ignore, max_shard_size, overwrite, base_model, progress,
             calib, nsamples, seqlen, act_order, damp, weighted_grids, seed, resume, device, checkpoint_format):
    """Quantize a checkpoint, streaming one tensor (gptq: one layer) at a time."""
    from . import distributed
    from .gptq_method import GptqOptions
    from .memory import peak_rss_mb
    from .planning import QuantizeOptions
    from .quantize import CalibrationInputs, Progress, quantize_checkpoint
    from .recipes import Override
    from .shards import parse_size

    if method not in CALIBRATED_METHODS and (calib or resume):
        raise click.UsageError(f"--calib and --resume apply to calibrated methods only ({', '.join(CALIBRATED_METHODS)})")
    ranks = distributed.SINGLE
    if method in CALIBRATED_METHODS:
        ranks = distributed.join(device)
    elif distributed.in_launcher() and os.environ.get("RANK", "0") != "0":
        return  # an uncalibrated run is rank 0's alone
    if Path(out).exists() and not overwrite and ranks.is_main:
        raise click.UsageError(f"{out} already exists; pass --overwrite to replace it")
    options = QuantizeOptions(
        group_size=_group_size(group_size), symmetric=symmetric, clip_search=clip_search,
        keep_embedding=keep_embedding, untie_head=untie_head, ignore=tuple(ignore),
        max_shard_bytes=parse_size(max_shard_size), method=method, checkpoint_format=checkpoint_format,
        recipe=recipe, embedding_bits=_bits(embedding_bits), head_bits=_bits(head_bits),
        overrides=tuple(Override.parse(o) for o in overrides), strict_group_size=strict_group_size,
    )
    if nsamples is None:
        nsamples = DEFAULT_NSAMPLES.get(method, 128)
    calibration = CalibrationInputs(calib, GptqOptions(nsamples=nsamples, seqlen=seqlen, act_order=act_order,
                                                       damp=damp, seed=seed, weighted_grids=weighted_grids), resume)
    start = time.perf_counter()
    shown = _ShownProgress(progress) if ranks.is_main else None
    try:
        _, report = quantize_checkpoint(model, out, options, overwrite, calibration, shown or Progress(), ranks,
                                        base_model)
    finally:
        if shown:
            shown.close()
        distributed.leave(ranks)
    if report is None:
        return
    s = report["summary"]
    click.echo(
        f"quantized {s['tensors_quantized']} tensors at group {report['quantization_config']['group_size']}: "
        f"{s['bits_per_weight']} bits/weight ({s['whole_model_bits_per_weight']} for the whole model), "
        f"min SNR {s['snr_db_min']} dB, {len(report['fallbacks'])} group fallbacks, "
        f"{s['source_bytes'] / 1e6:.1f} MB -> {s['output_bytes'] / 1e6:.1f} MB in "
        f"{time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mb():.0f} MiB -> {out}"
    )


class _ShownProgress:
    """Progress on stderr (only with ``enabled``; notes always): bars with rate and ETA on a
    terminal, plain lines otherwise (see cli_progress)."""

    def __init__(self, enabled: bool):
        from .cli_progress import StepReporter

        self.enabled, self.bytes, self.steps = enabled, None, StepReporter(enabled, unit="layer")

    def start(self, total_bytes: int) -> None:
        from .cli_progress import Steps

        self.bytes = Steps("quantize", total_bytes, unit="B", enabled=self.enabled, every=0.1)

    def advance(self, nbytes: int) -> None:
        self.bytes.update(self.bytes.done + nbytes)

    def step(self, what: str, done: int, total: int, note: str = "") -> None:
        self.steps(what, done, total, note)

    def say(self, message: str) -> None:
        if self.enabled:
            click.echo(f"int4q: {message}", err=True)

    def note(self, message: str) -> None:
        click.echo(f"int4q: note: {message}", err=True)

    def close(self) -> None:
        if self.bytes is not None:
            self.bytes.close()
        self.steps.close()


@main.command("bundled-model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def bundled_model(out, overwrite):
    """Write the bundled SmolLM2-135M-Instruct as a bf16 checkpoint to OUT."""
    from .bundled import build_default_model, is_bundled_output

    if Path(out).exists() and not overwrite:
        if not is_bundled_output(out):
            raise click.UsageError(f"{out} exists and is not the bundled model; choose another folder")
        click.echo(f"{out} already holds the bundled model; keeping it")
        return
    build_default_model(out, overwrite=overwrite)
    click.echo(f"wrote SmolLM2-135M-Instruct (bf16) -> {out}")


def _register() -> None:
    from .cli_publish import push, verify
    from .cli_runtime import bench, generate

    for command in (generate, bench, verify, push):
        main.add_command(command)


_register()
