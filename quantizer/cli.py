"""The ``int4q`` command line: parse options, show progress, turn errors into one line and an
exit code. No quantization logic lives here."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import click

from .errors import Int4qError


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
            raise click.ClickException(str(e) + kept) from None
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
            f"internal error: {type(e).__name__}: {first} (set INT4Q_DEBUG=1 for the traceback)" + kept
        ) from None


OS_ERRORS = {
    errno.ENOSPC: "no space left on the device while writing {where}; free space or choose another --out",
    errno.EDQUOT: "disk quota exceeded while writing {where}; free space or choose another --out",
    errno.EACCES: "permission denied: {where}; choose a folder you can write to",
    errno.EPERM: "operation not permitted: {where}; choose a folder you can write to",
    errno.EROFS: "read-only file system: {where}; choose a writable folder",
}


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


def peak_rss_mb() -> float:
    """Peak resident set size of this process image, in MiB.

    VmHWM, not ru_maxrss: the latter survives exec and so counts a large parent's pages that a
    forked child briefly shared."""
    from .checkpoint import proc_status_mb

    return proc_status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


VERIFY_EXIT = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}


def _group_size(value: str) -> int | None:
    return None if value == "auto" else int(value)


@main.command()
@click.option("--model", "model", required=True, help="bf16/fp16/fp32 model folder or Hub repo id.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Output folder.")
@click.option(
    "--group-size", default="auto", show_default=True,
    type=click.Choice(["auto", "32", "64", "128", "256"]),
    help="Input columns per scale/zero group; auto = largest of 128/64/32 dividing every input dim.",
)
@click.option("--method", default="minmax", show_default=True, type=click.Choice(["minmax", "gptq"]),
              help="minmax: round-to-nearest on each group's min/max grid; gptq: GPTQ with calibration text.")
@click.option("--sym/--asym", "symmetric", default=False, show_default=True,
              help="Symmetric grid (zero fixed at 0) or asymmetric min/max grid.")
@click.option("--search", "clip_search", is_flag=True, help="Per-group clipping search minimising squared error.")
@click.option("--keep-embedding", is_flag=True, help="Leave the vocabulary table in bf16.")
@click.option("--untie-head", is_flag=True, help="Write a separately quantized lm_head; sets tie_word_embeddings false.")
@click.option("--ignore", multiple=True, help="Module name (or suffix) to leave unquantized; repeatable.")
@click.option("--max-shard-size", default="2GB", show_default=True, help="Largest output shard, e.g. 2GB, 500MB.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show progress on stderr.")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="[gptq] Calibration text (plain, or .jsonl with a 'text' field). Default: the calibration "
                   "half of CPython's pydoc_data.topics (verify evaluates on the other half).")
@click.option("--nsamples", default=128, show_default=True, type=click.IntRange(1, 100_000),
              help="[gptq] Calibration windows.")
@click.option("--seqlen", default=512, show_default=True, type=click.IntRange(8, 100_000),
              help="[gptq] Tokens per calibration window.")
@click.option("--act-order/--no-act-order", default=True, show_default=True,
              help="[gptq] Visit columns by decreasing Hessian diagonal (groups stay static: no g_idx).")
@click.option("--damp", default=0.01, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="[gptq] Dampening, as a fraction of the mean Hessian diagonal.")
@click.option("--seed", default=0, show_default=True, type=int, help="[gptq] Seed for the calibration windows.")
@click.option("--resume", is_flag=True, help="[gptq] Continue an interrupted run from its last finished layer.")
@click.option("--format", "checkpoint_format", default="cpu_int4", show_default=True,
              type=click.Choice(["cpu_int4", "gptq"]),
              help="[gptq] cpu_int4 (this runtime, verify, push) or the GPTQ v1 layout (qweight/qzeros/scales/"
                   "g_idx) for vLLM's W4A8 CPU path and GPTQ loaders; the embedding then stays bf16.")
def quantize(model, out, group_size, method, symmetric, clip_search, keep_embedding, untie_head, ignore,
             max_shard_size, overwrite, progress, calib, nsamples, seqlen, act_order, damp, seed, resume,
             checkpoint_format):
    """Quantize a checkpoint to the cpu_int4 format, streaming one tensor (gptq: one layer) at a time."""
    from tqdm import tqdm

    from .checkpoint import parse_size, resolve_model_dir
    from .outdir import atomic_output_dir, check_free_space, check_output_target, partial_dir
    from .pipeline import QuantizeOptions, plan_quantization, run_quantization

    if method != "gptq" and (calib or resume or checkpoint_format != "cpu_int4"):
        raise click.UsageError("--calib, --resume and --format apply to --method gptq only")
    if Path(out).exists() and not overwrite:
        raise click.UsageError(f"{out} already exists; pass --overwrite to replace it")
    options = QuantizeOptions(
        group_size=_group_size(group_size), symmetric=symmetric, clip_search=clip_search,
        keep_embedding=keep_embedding or checkpoint_format == "gptq", untie_head=untie_head or method == "gptq",
        ignore=tuple(ignore),
        max_shard_bytes=parse_size(max_shard_size), method=method,
    )
    start = time.perf_counter()
    model_dir = resolve_model_dir(model)
    inputs = [model_dir] + ([calib] if calib else [])
    check_output_target(out, overwrite, inputs)
    plan = dataclasses.replace(plan_quantization(model_dir, options), source_name=model)
    check_free_space(out, plan.disk_bytes_needed(nsamples * seqlen if method == "gptq" else 0))
    if method == "gptq":
        from .gptq_pipeline import GptqOptions, run_gptq
        from .runtime import load_tokenizer
        from .textdata import load_text

        text, origin = load_text(calib, "calib")
        gptq_options = GptqOptions(nsamples=nsamples, seqlen=seqlen, act_order=act_order, damp=damp, seed=seed,
                                   checkpoint_format=checkpoint_format)
        tokenizer = load_tokenizer(model_dir)
        say = (lambda m: click.echo(f"int4q: {m}", err=True)) if progress else None
        try:
            with atomic_output_dir(out, overwrite, keep_partial=True, resume=resume, inputs=inputs) as tmp:
                report = run_gptq(plan, tmp, tokenizer, text, origin, gptq_options, resume=resume, progress=say)
        except BaseException as e:
            if partial_dir(out).exists():
                e.int4q_kept = (f"; the finished layers are kept in {partial_dir(out)}: rerun the same command "
                                "with --resume to continue, or delete that folder")
            raise
    else:
        bar = tqdm(total=plan.reader.total_bytes, unit="B", unit_scale=True, desc="quantize", disable=not progress,
                   file=sys.stderr)
        with atomic_output_dir(out, overwrite, inputs=inputs) as tmp:
            report = run_quantization(plan, tmp, progress=lambda name, nbytes: bar.update(nbytes))
        bar.close()
    s = report["summary"]
    click.echo(
        f"quantized {s['tensors_quantized']} tensors at group {plan.qconfig.group_size}: "
        f"{s['bits_per_weight']} bits/weight, min SNR {s['snr_db_min']} dB, "
        f"{s['source_bytes'] / 1e6:.1f} MB -> {s['output_bytes'] / 1e6:.1f} MB in "
        f"{time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mb():.0f} MiB -> {out}"
    )


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


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", required=True, help="Text to continue (or the user message with --chat).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--threads", type=click.IntRange(1, 1024), help="Torch intra-op threads (default: torch's choice).")
@click.option("--compile/--no-compile", default=True, show_default=True,
              help="Compile the decode step (cached on disk after the first run).")
@click.option("--stats", is_flag=True, help="Print load time, time to first token and decode speed to stderr.")
def generate(model_dir, prompt, max_new_tokens, chat, threads, compile, stats):
    """Greedy generation from a cpu_int4 (or bf16) checkpoint, streamed to stdout."""
    from .runtime import load_model, load_tokenizer
    from .runtime.generation import GenerationStats, generate_text

    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    started = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, threads=threads)
    loaded = time.perf_counter()
    counts = GenerationStats()
    for piece in generate_text(model, tokenizer, prompt, max_new_tokens, chat=chat, compile=compile, stats=counts):
        click.echo(piece, nl=False)
    click.echo()
    sys.stdout.flush()
    if stats and counts.first_token_at:
        steps = counts.new_tokens - 1
        rate = steps / (counts.last_token_at - counts.first_token_at) if steps else float("nan")
        click.echo(f"int4q: load {loaded - started:.2f} s, time to first token {counts.first_token_at - started:.2f} s "
                   f"({counts.prompt_tokens} prompt tokens), then {steps} tokens at {rate:.1f} tok/s", err=True)


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A bf16 checkpoint to measure in the same process, arms interleaved.")
@click.option("--prompt-tokens", default=512, show_default=True, type=click.IntRange(0, 100_000),
              help="Prefill length (pp); 0 skips prefill.")
@click.option("--gen-tokens", default=128, show_default=True, type=click.IntRange(0, 100_000),
              help="Decode steps (tg), not counting the prompt's forward; 0 skips decode.")
@click.option("--reps", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--threads", type=click.IntRange(1, 1024), help="Torch intra-op threads (default: torch's choice).")
@click.option("--compile/--no-compile", default=True, show_default=True,
              help="Compile the decode step (cached on disk after the first run).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write every number here.")
def bench(model_dir, baseline, prompt_tokens, gen_tokens, reps, threads, compile, json_path):
    """llama-bench style prefill and decode speed, and resident memory after load."""
    import json

    import torch

    from .runtime.bench import bench_models

    if json_path and not json_path.parent.is_dir():
        raise click.BadParameter(f"folder {json_path.parent} does not exist", param_hint="--json")
    if threads:
        torch.set_num_threads(threads)

    def show(rep, name, r):
        click.echo(f"  rep {rep + 1}/{reps} {name}: pp {r.pp[-1] if r.pp else 0:.1f} tok/s, "
                   f"tg {r.tg[-1] if r.tg else 0:.2f} tok/s", err=True)

    out = bench_models(model_dir, baseline, prompt_tokens, gen_tokens, reps, compile=compile, progress=show)
    click.echo(f"threads {out['machine']['threads']}, torch {out['machine']['torch']}, pp{prompt_tokens} tg{gen_tokens}, "
               f"{reps} reps (best / median)")
    for name, r in out["arms"].items():
        click.echo(f"{name:>9}: pp {r['pp_best']} / {r['pp_median']} tok/s   tg {r['tg_best']} / {r['tg_median']} tok/s"
                   f"   RssAnon after load {r['rss_anon_after_load_mb']} MiB   ({r['decode_path']} decode)")
    if "ratios_int4_over_baseline" in out:
        click.echo("    ratio: " + ", ".join(f"{k} {v}" for k, v in out["ratios_int4_over_baseline"].items()))
    click.echo(f"peak RSS of the process {out['peak_rss_mb']} MiB")
    if json_path:
        json_path.write_text(json.dumps(out, indent=2) + "\n")


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--model", "source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The bf16 source checkpoint: enables the round-trip and end-to-end checks.")
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Evaluation text (plain, or .jsonl with a 'text' field). Default: the held-out half of "
                   "CPython's pydoc_data.topics.")
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(16, 100_000),
              help="Window length for KLD/perplexity; the second half of each window is scored.")
@click.option("--max-windows", default=16, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--greedy-tokens", default=32, show_default=True, type=click.IntRange(0, 10_000),
              help="New tokens per greedy prompt; 0 skips the greedy comparison.")
@click.option("--max-kld", type=click.FloatRange(min=0), help="Fail when the mean KLD exceeds this.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write every number here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a PNG of per-tensor SNR (and the KLD distribution).")
@click.option("--threads", type=click.IntRange(1, 1024), help="Torch intra-op threads.")
def verify(model_dir, source, text, ctx, max_windows, greedy_tokens, max_kld, json_path, plot_path, threads):
    """Check a cpu_int4 checkpoint. Exit 0: PASS (every check ran and passed); 1: FAIL (a check
    failed); 2: bad usage; 3: INCOMPLETE (a check could not run, e.g. the models would not load)."""
    import json

    import torch

    from .verify_report import run_verify

    if threads:
        torch.set_num_threads(threads)
    if max_kld is not None and source is None:
        raise click.UsageError("--max-kld needs --model (the source to compare against)")
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'int4q[plot]'") from None
    report = run_verify(model_dir, source, text, ctx, max_windows, greedy_tokens, max_kld,
                        say=lambda m: click.echo(m, err=True))
    for line in report["summary_lines"]:
        click.echo(line)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    if plot_path:
        from .verify_report import plot_report

        plot_report(report, plot_path)
    click.echo(report["outcome"])
    sys.exit(VERIFY_EXIT[report["outcome"]])


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--repo-id", required=True, help="namespace/name on the Hub.")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", help="Branch to commit to (created if missing). Default: main.")
@click.option("--commit-message", help="Commit title.")
@click.option("--endpoint", envvar="HF_ENDPOINT", help="Hub URL (default: huggingface.co, or HF_ENDPOINT).")
@click.option("--token", help="Access token (default: HF_TOKEN, then the token huggingface_hub stored).")
@click.option("--dry-run", is_flag=True, help="List what would be uploaded, with sizes; contact nothing.")
@click.option("--no-verify", is_flag=True, help="Skip verify's structural check before uploading.")
def push(folder, repo_id, private, revision, commit_message, endpoint, token, dry_run, no_verify):
    """Publish a quantized folder to the Hugging Face Hub in one commit, with a model card."""
    from . import hub

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise click.BadParameter("expected namespace/name", param_hint="--repo-id")
    if not no_verify:
        hub.check_publishable(folder)
    if dry_run:
        files = hub.upload_files(folder)
        if not (folder / hub.CARD_NAME).exists():
            click.echo(f"{hub.CARD_NAME:<50} (generated model card)")
        for f in files:
            click.echo(f"{f.path:<50} {f.size:>14,} bytes")
        click.echo(f"{len(files)} files, {sum(f.size for f in files):,} bytes -> {repo_id} (dry run: nothing sent)")
        return
    files = hub.upload_files(folder)
    click.echo(f"int4q: pushing {len(files)} files ({sum(f.size for f in files) / 1e6:.1f} MB) to {repo_id}; "
               "unchanged files are skipped", err=True)
    url = hub.push(folder, repo_id, hub.resolve_token(token), endpoint, private, revision, commit_message)
    click.echo(url)
