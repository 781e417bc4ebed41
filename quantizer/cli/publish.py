"""The ``int4q verify`` and ``int4q push`` commands: prove a checkpoint, then publish it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .runtime import activation_options, choose_activations

VERIFY_EXIT = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, path_type=Path))
@click.option("--reference", "--model", "source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The bf16 checkpoint it was quantized from (--model, as in quantize, names the same folder): "
                   "enables the round-trip and end-to-end checks.")
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
@activation_options
def verify(model_dir, source, text, ctx, max_windows, greedy_tokens, max_kld, json_path, plot_path, threads, decode,
           prefill):
    """Check a cpu_int4 checkpoint (or a .gguf file int4q wrote). Exit 0: PASS (every check ran and passed); 1: FAIL (a check
    failed); 2: bad usage; 3: INCOMPLETE (a check could not run, e.g. the models would not load)."""
    import json

    import torch

    from ..verification.run import run_verify
    from .progress import StepReporter

    if threads:
        torch.set_num_threads(threads)
    choose_activations(decode, prefill)
    if max_kld is not None and source is None:
        raise click.UsageError("--max-kld needs --reference (the source to compare against)")
    for option, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None and not path.parent.is_dir():
            raise click.BadParameter(f"{path.parent} is not a folder; create it or write elsewhere", param_hint=option)
        if path is not None and path.is_symlink():
            raise click.BadParameter(f"{path} is a link; int4q never writes through one: name the file itself",
                                     param_hint=option)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'int4q[plot]'") from None
    steps = StepReporter(unit="window")
    try:
        report = run_verify(model_dir, source, text, ctx, max_windows, greedy_tokens, max_kld,
                            say=lambda m: click.echo(m, err=True), step=steps)
    finally:
        steps.close()
    for line in report["summary_lines"]:
        click.echo(line)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    if plot_path:
        from ..verification.run import plot_report

        plot_report(report, plot_path)
    click.echo(report["outcome"])
    sys.exit(VERIFY_EXIT[report["outcome"]])


@click.command()
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
    from ..hub import push as hub
    from ..hub.card import CARD_NAME
    from ..io.source import HUB_ID
    from .progress import is_terminal

    if HUB_ID.fullmatch(repo_id) is None:
        raise click.BadParameter("expected namespace/name, each starting with a letter or digit",
                                 param_hint="--repo-id")
    if not no_verify:
        hub.check_publishable(folder)
    if dry_run:
        files = hub.upload_files(folder)
        if not os.path.lexists(folder / CARD_NAME):
            click.echo(f"{CARD_NAME:<50} (generated model card)")
        for f in files:
            click.echo(f"{f.path:<50} {f.size:>14,} bytes")
        click.echo(f"{len(files)} files, {sum(f.size for f in files):,} bytes -> {repo_id} (dry run: nothing sent)")
        return
    files = hub.upload_files(folder)
    click.echo(f"int4q: pushing {len(files)} files ({sum(f.size for f in files) / 1e6:.1f} MB) to {repo_id}; "
               "unchanged files are skipped", err=True)
    url = hub.push(folder, repo_id, hub.resolve_token(token), endpoint, private, revision, commit_message,
                   show_bars=is_terminal())  # off a terminal, the line above is the progress
    click.echo(url)
