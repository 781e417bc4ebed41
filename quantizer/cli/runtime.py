"""The ``int4q generate`` and ``int4q bench`` commands: run a checkpoint."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from ..runtime.activations import CHOICES, KV_CACHES


def activation_options(command):
    """``--decode`` and ``--prefill``: the int4 linears' activation precision (see
    :mod:`quantizer.runtime.activations`); the command calls :func:`choose_activations` with them."""
    for phase, rows in (("prefill", "from dequant_threshold rows on: prompts"),
                        ("decode", "below dequant_threshold: one token at a time; int8 also attends in fp32")):
        command = click.option(f"--{phase}", type=click.Choice(CHOICES),
                               help=f"Activations of the int4 linears' {phase} ({rows}): exact bf16, or rounded "
                                    f"to int8 per weight group (faster where the CPU has AVX-512 VNNI, or for decode "
                                    f"AVX2). Default: "
                                    f"$INT4Q_ACTIVATIONS, else int8.")(command)
    return command


def kv_cache_option(command):
    """``--kv-cache``: what the fast decoder's KV cache holds (:data:`..runtime.activations.KV_CACHES`)."""
    return click.option("--kv-cache", type=click.Choice(KV_CACHES), default="bf16", show_default=True,
                        help="The decoder's KV cache: bf16, or int8 codes with their scales (0.54x the bytes a token "
                             "reads from it at depth; needs int8 decode activations; docs/runtime.md).")(command)


def choose_activations(decode: str | None, prefill: str | None) -> None:
    """Apply ``--decode``/``--prefill`` to this process (and the compile worker it may start)."""
    from ..runtime.activations import choose

    choose(decode, prefill)


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", required=True, help="Text to continue (or the user message with --chat).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--threads", type=click.IntRange(1, 1024), help="Torch intra-op threads (default: torch's choice).")
@click.option("--compile/--no-compile", default=None,
              help="Use the compiled decode step (made once per model and machine, in the background; "
                   "decoding starts eagerly meanwhile). Default: from --max-new-tokens 1024 on, where reading "
                   "the saved step pays for itself.")
@click.option("--stats", is_flag=True, help="Print load time, time to first token (from the command's start) and "
                                           "decode speed to stderr.")
@kv_cache_option
@activation_options
def generate(model_dir, prompt, max_new_tokens, chat, threads, compile, stats, kv_cache, decode, prefill):
    """Greedy generation from a cpu_int4 (or bf16) checkpoint, streamed to stdout."""
    import torch

    from ..runtime.decode.generation import GenerationStats, generate_text
    from ..runtime.decode.snapshot import quick_text

    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    choose_activations(decode, prefill)
    started = time.perf_counter() - _seconds_since_process_start()
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    counts = GenerationStats()
    pieces = quick_text(model_dir, prompt, max_new_tokens, chat, counts) if kv_cache == "bf16" else None
    model = tokenizer = None
    if pieces is None:
        model, tokenizer, compile = _load_for_generate(model_dir, max_new_tokens, threads, compile)
        pieces = generate_text(model, tokenizer, prompt, max_new_tokens, chat=chat, compile=compile, stats=counts,
                               source=model_dir, kv_cache=kv_cache)
    loaded = time.perf_counter()
    for piece in pieces:
        click.echo(piece, nl=False)
    click.echo()
    sys.stdout.flush()
    if stats and counts.first_token_at:
        steps = counts.new_tokens - 1
        rate = steps / (counts.last_token_at - counts.first_token_at) if steps else float("nan")
        click.echo(f"int4q: load {loaded - started:.2f} s, time to first token {counts.first_token_at - started:.2f} s "
                   f"({counts.prompt_tokens} prompt tokens), then {steps} tokens at {rate:.1f} tok/s", err=True)
    if model is not None:
        _save_quick_start(model, tokenizer, model_dir)


def _load_for_generate(model_dir: Path, max_new_tokens: int, threads: int, compile: bool | None):
    """(model, tokenizer, compile): the checkpoint loaded through transformers, and whether to
    compile its decode step."""
    import torch

    from ..io.tokenizer import load_tokenizer
    from ..runtime import load_model
    from ..runtime.decode.background import threads_beside_worker
    from ..runtime.decode.generation import step_pays

    tokenizer = load_tokenizer(model_dir)
    compile = step_pays(max_new_tokens) if compile is None else compile
    model = load_model(model_dir, threads=threads_beside_worker(threads) if compile else threads)
    torch.set_num_threads(threads)
    return model, tokenizer, compile


def _save_quick_start(model, tokenizer, model_dir: Path) -> None:
    """Save the model's snapshot for quick starts (one line on stderr when one is written)."""
    from ..runtime.decode.snapshot import ENV, save_snapshot

    saved = save_snapshot(model, tokenizer, model_dir)
    if saved:
        folder, size = saved
        click.echo(f"int4q: saved this model's decode plan for quick starts ({size / 2**20:.0f} MiB in {folder}); "
                   f"{ENV}=0 turns them off", err=True)


def _seconds_since_process_start() -> float:
    """How long ago this process started (Python's own start and imports included); 0 where
    /proc does not say."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@click.command("compile")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--threads", type=click.IntRange(1, 1024),
              help="The thread count generate and bench will run at (default: torch's choice).")
@click.option("--max-len", default=256, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Prompt plus new tokens the step serves (models int4q's own decoder does not cover compile one "
                   "step per power of two).")
@activation_options
def compile_step(model_dir, threads, max_len, decode, prefill):
    """Compile and save a checkpoint's decode step now, so the first generate runs at full speed."""
    import torch

    from ..runtime.decode.background import compile_and_save

    choose_activations(decode, prefill)
    artifact, outcome = compile_and_save(model_dir, threads or torch.get_num_threads(), max_len)
    click.echo(f"decode step {outcome}: {artifact}")


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A bf16 checkpoint to measure in the same process, arms interleaved.")
@click.option("--prompt-tokens", default=512, show_default=True, type=click.IntRange(0, 100_000),
              help="Prefill length (pp); 0 skips prefill.")
@click.option("--gen-tokens", default=128, show_default=True, type=click.IntRange(0, 100_000),
              help="Decode steps (tg), not counting the prompt's forward; 0 skips decode.")
@click.option("--depth", default=0, show_default=True, type=click.IntRange(0, 1_000_000),
              help="Tokens of context before the decode steps (as llama-bench's -d); its prefill is not timed.")
@click.option("--reps", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--threads", type=click.IntRange(1, 1024), help="Torch intra-op threads (default: torch's choice).")
@click.option("--compile/--no-compile", default=True, show_default=True,
              help="Compile the decode step (cached on disk after the first run).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write every number here.")
@click.option("--compare-exact", is_flag=True,
              help="Also measure the checkpoint with exact activations (arm 'exact'), interleaved with the others.")
@kv_cache_option
@click.option("--compare-kv", is_flag=True,
              help="With --kv-cache int8: also decode the same model over a bf16 cache (arm 'bf16kv'), interleaved.")
@activation_options
def bench(model_dir, baseline, prompt_tokens, gen_tokens, depth, reps, threads, compile, json_path, compare_exact,
          kv_cache, compare_kv, decode, prefill):
    """llama-bench style prefill and decode speed, and resident memory after load."""
    import json

    import torch

    from ..runtime.bench import bench_models
    from .progress import StepReporter

    if json_path and not json_path.parent.is_dir():
        raise click.BadParameter(f"folder {json_path.parent} does not exist", param_hint="--json")
    if compare_kv and kv_cache == "bf16":
        raise click.BadParameter("compares an int8 KV cache with the bf16 one: add --kv-cache int8",
                                 param_hint="--compare-kv")
    if threads:
        torch.set_num_threads(threads)
    choose_activations(decode, prefill)

    arms = 1 + bool(baseline) + compare_exact + compare_kv
    steps = StepReporter(unit="run")
    runs = iter(range(1, reps * arms + 1))

    def show(rep, name, r):
        steps("bench runs", next(runs), reps * arms,
              f"{name} pp {r.pp[-1] if r.pp else 0:.1f} tg {r.tg[-1] if r.tg else 0:.2f} tok/s")

    try:
        out = bench_models(model_dir, baseline, prompt_tokens, gen_tokens, reps, compile=compile, progress=show,
                           compare_exact=compare_exact, depth=depth, kv_cache=kv_cache, compare_kv=compare_kv)
    finally:
        steps.close()
    at_depth = f" at depth {depth}" if depth else ""
    click.echo(f"threads {out['machine']['threads']}, torch {out['machine']['torch']}, pp{prompt_tokens} "
               f"tg{gen_tokens}{at_depth}, "
               f"{reps} reps (best / median), int4 activations {out['activations']}, int4 KV cache {kv_cache}")
    for name, r in out["arms"].items():
        pp = f"pp {r['pp_best']} / {r['pp_median']} tok/s   " if prompt_tokens else ""
        tg = f"tg {r['tg_best']} / {r['tg_median']} tok/s   " if gen_tokens else ""
        click.echo(f"{name:>9}: {pp}{tg}RssAnon after load {r['rss_anon_after_load_mb']} MiB   "
                   f"({r['decode_path']} decode)")
    for key in ("ratios_int4_over_baseline", "ratios_int4_over_exact", "ratios_int4_over_bf16kv"):
        if key in out:
            click.echo(f"{key.split('_')[-1]:>9} ratio: " + ", ".join(f"{k} {v}" for k, v in out[key].items()))
    click.echo(f"peak RSS of the process {out['peak_rss_mb']} MiB")
    if json_path:
        json_path.write_text(json.dumps(out, indent=2) + "\n")
