"""Runs the verify checks in order and turns their results into a report dict (and a plot)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import InputError, UsageError
from .structure import CheckResult, check_structure
from .tensors import check_kernel_layout, check_round_trip


def run_verify(qdir: Path, source: Path | None, text: Path | None, ctx: int, max_windows: int,
               greedy_tokens: int, max_kld: float | None, say: Callable[[str], None],
               step: Callable[..., None] | None = None) -> dict:
    """Structure, then (with ``source``) round trip, kernel layout, end to end. Returns the report:
    ``ok``, ``checks``, ``tensors`` (per-tensor SNR), ``fidelity`` and readable ``summary_lines``.
    A .gguf file gets the checks of :func:`run_verify_gguf`."""
    from .gguf import is_gguf_path

    if is_gguf_path(qdir):
        return run_verify_gguf(qdir, source, text, ctx, max_windows, greedy_tokens, max_kld, say, step)
    if max_kld is not None and _is_base_model(qdir):
        raise UsageError(f"--max-kld compares logits, and {qdir} is a base model (no head) whose end-to-end check "
                         "compares hidden states; drop --max-kld")
    checks: list[CheckResult] = []
    report: dict = {"checkpoint": str(qdir), "source": str(source) if source else None}
    numbers: list[str] = []
    say("structure ...")
    structure, info = check_structure(qdir)
    checks.append(structure)
    if structure.ok:
        if source is not None:
            say("round trip against the source ...")
            source_structure = _source_structure(source)
            round_trip, stats = check_round_trip(info, source, source_structure)
            checks.append(round_trip)
            _tensor_numbers(stats, report, numbers)
            _left_out_numbers(source_structure, numbers)
        say("kernel layout ...")
        checks.append(check_kernel_layout(info))
        if source is not None and all(c.ok for c in checks):
            checks.append(_end_to_end(qdir, source, text, ctx, max_windows, greedy_tokens, max_kld, report,
                                      numbers, say, step or (lambda *a: None)))
    return _finish(report, checks, numbers)


def run_verify_gguf(path: Path, source: Path | None, text: Path | None, ctx: int, max_windows: int,
                    greedy_tokens: int, max_kld: float | None, say: Callable[[str], None],
                    step: Callable[..., None] | None = None) -> dict:
    """A .gguf int4q wrote: readable with int4q's config; with ``source``, its tensors and metadata
    against llama.cpp's converter's for the source, the round trip, and end to end (the file
    dequantized by transformers' GGUF loader)."""
    from ..errors import Int4qError
    from ..formats.gguf.assemble import converted_source
    from ..io.checkpoint import read_config
    from .gguf import check_round_trip as gguf_round_trip
    from .gguf import check_structure as gguf_structure
    from .gguf import load_dequantized, read_gguf

    report: dict = {"checkpoint": str(path), "source": str(source) if source else None}
    checks, numbers = [], []
    say("structure ...")
    try:
        reader, qconfig = read_gguf(path)
    except Int4qError as e:
        return _finish(report, [CheckResult("structure", [str(e)])], numbers)
    if source is None:
        return _finish(report, [CheckResult("structure")], numbers)
    config = read_config(source)
    say("running llama.cpp's converter over the source ...")
    expected, kv = converted_source(source, config)
    source_structure = _source_structure(source)
    checks.append(gguf_structure(reader, expected, kv, source_structure.tied))
    say("round trip against the source ...")
    round_trip, stats = gguf_round_trip(reader, expected, qconfig, expected.get("token_embd.weight"))
    checks.append(round_trip)
    _tensor_numbers(stats, report, numbers)
    _left_out_numbers(source_structure, numbers)
    if all(c.ok for c in checks):
        checks.append(_end_to_end(path, source, text, ctx, max_windows, greedy_tokens, max_kld, report, numbers,
                                  say, step or (lambda *a: None), lambda: load_dequantized(path)))
    return _finish(report, checks, numbers)


def _tensor_numbers(stats, report: dict, numbers: list[str]) -> None:
    report["tensors"] = {s.module: {"snr_db": s.snr_db, "max_abs_err": s.max_abs_err,
                                    "max_excess_over_nearest": s.max_excess} for s in stats}
    snrs = [s.snr_db for s in stats if s.snr_db is not None]
    if snrs:
        numbers.append(f"SNR over {len(stats)} quantized tensors: min {min(snrs):.2f} dB, "
                       f"mean {sum(snrs) / len(snrs):.2f} dB, max {max(snrs):.2f} dB; "
                       f"max abs error {max(s.max_abs_err for s in stats):.4g}")


def _source_structure(source: Path):
    """The source checkpoint's module tree (:class:`~quantizer.io.structure.ModelStructure`)."""
    from ..io.checkpoint import read_config
    from ..io.structure import inspect_structure

    return inspect_structure(read_config(source))


def _left_out_numbers(structure, numbers: list[str]) -> None:
    """The line naming the module types int4q left in bf16, where the source has any."""
    note = structure.left_out_note()
    if note:
        numbers.append(note)


def _finish(report: dict, checks: list[CheckResult], numbers: list[str]) -> dict:
    lines = []
    for c in checks:
        label = {"ok": "ok", "failed": "FAILED", "could not run": "COULD NOT RUN"}[c.outcome]
        lines.append(f"[{label}] {c.name}" + (f": {c.could_not_run}" if c.could_not_run else ""))
        lines.extend(f"    {p}" for p in c.problems[:10])
        if len(c.problems) > 10:
            lines.append(f"    ... and {len(c.problems) - 10} more")
    report["checks"] = [c.as_dict() for c in checks]
    report["ok"] = all(c.ok for c in checks)
    report["outcome"] = verdict(checks)
    report["summary_lines"] = lines + numbers
    return report


def verdict(checks: list[CheckResult]) -> str:
    """PASS when every check ran and passed, FAIL when one failed, else INCOMPLETE."""
    if any(c.problems for c in checks):
        return "FAIL"
    return "PASS" if all(c.ok for c in checks) else "INCOMPLETE"


def _end_to_end(qdir, source, text, ctx, max_windows, greedy_tokens, max_kld, report, numbers, say,
                step, load_quantized=None) -> CheckResult:
    from ..io.tokenizer import load_tokenizer
    from ..runtime import load_model
    from ..runtime.activations import current as current_activations
    from .fidelity import greedy_agreement, teacher_forced

    if load_quantized is None and _is_base_model(qdir):
        return _base_model_end_to_end(qdir, source, text, ctx, max_windows, report, numbers, say, step)
    result = CheckResult("end to end")
    loaded = _models_and_windows(lambda: (load_tokenizer(source if load_quantized else qdir), load_model(source),
                                          load_quantized() if load_quantized else load_model(qdir)),
                                 text, ctx, max_windows, result)
    if loaded is None:
        return result
    reference, quantized, tokenizer, windows, origin = loaded
    say(f"teacher-forced KLD over {len(windows)} windows of {ctx} tokens from {origin} ...")
    fid = teacher_forced(reference, quantized, windows, progress=lambda done, total: step("KLD windows", done, total))
    if greedy_tokens:
        say(f"greedy generation, {greedy_tokens} tokens per prompt ...")
        greedy_agreement(reference, quantized, tokenizer, greedy_tokens, fid,
                         progress=lambda done, total: step("greedy prompts", done, total))
    activations = current_activations().encode()
    report["fidelity"] = {**fid.as_dict(), "text": origin, "ctx": ctx, "activations": activations}
    numbers.append(f"KLD vs source over {fid.tokens_scored} tokens ({origin}, ctx {ctx}, activations {activations}): "
                   f"mean {fid.kld_mean:.5f}, "
                   f"p99.9 {fid.kld_p999:.4f}, max {fid.kld_max:.4f}; top-1 agreement {100 * fid.top1_agreement:.2f}%")
    numbers.append(f"perplexity: source {fid.ppl_reference:.4f}, quantized {fid.ppl_quantized:.4f}, "
                   f"ratio {fid.ppl_ratio:.4f}")
    if greedy_tokens:
        numbers.append(f"greedy exact match: {fid.greedy_matches}/{fid.greedy_total} prompts ({greedy_tokens} tokens)")
    if max_kld is not None and fid.kld_mean > max_kld:
        result.fail(f"mean KLD {fid.kld_mean:.5f} exceeds --max-kld {max_kld}")
    return result


def _models_and_windows(load, text, ctx: int, max_windows: int, result: CheckResult):
    """``load()``'s (tokenizer, reference, quantized) and the evaluation windows of ``ctx`` tokens:
    (reference, quantized, tokenizer, windows, the text's origin), or None with ``result`` saying
    why the check could not run where the models do not load."""
    from ..io.text import load_text, text_budget
    from .fidelity import token_windows

    try:
        tokenizer, reference, quantized = load()
    except Exception as e:  # whatever stops the models from loading, the check did not run
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        result.could_not_run = f"cannot load the models ({first})"
        return None
    body, origin = load_text(text, "eval", text_budget(ctx * max_windows))
    return reference, quantized, tokenizer, token_windows(tokenizer, body, ctx, max_windows), origin


def _is_base_model(qdir: Path) -> bool:
    """Whether ``qdir``'s config names a base model (no head); False where it cannot be read,
    which the structure check reports."""
    from ..io.checkpoint import read_config
    from ..io.structure import is_base_model

    try:
        return is_base_model(read_config(qdir))
    except InputError:
        return False


def _base_model_end_to_end(qdir, source, text, ctx, max_windows, report, numbers, say,
                           step) -> CheckResult:
    """A base model's end-to-end check: its last hidden states against the source's over the same
    windows (:func:`.fidelity.hidden_state_agreement`), both loaded by int4q's runtime (the
    checkpoint on int4q's kernels) as transformers' base model class."""
    from ..io.tokenizer import load_tokenizer
    from ..runtime import load_model
    from .fidelity import hidden_state_agreement

    result = CheckResult("end to end")
    loaded = _models_and_windows(lambda: (load_tokenizer(qdir), load_model(source, base_model_ok=True),
                                          load_model(qdir, base_model_ok=True)), text, ctx, max_windows, result)
    if loaded is None:
        return result
    reference, quantized, _, windows, origin = loaded
    say(f"last hidden states over {len(windows)} windows of {ctx} tokens from {origin} (a base model: no logits) ...")
    hidden = hidden_state_agreement(reference, quantized, windows, lambda done, total: step("windows", done, total))
    report["hidden_states"] = {**hidden.as_dict(), "text": origin, "ctx": ctx}
    numbers.append(f"last hidden states vs source over {hidden.tokens} tokens ({origin}, ctx {ctx}): cosine mean "
                   f"{hidden.cosine_mean:.5f}, min {hidden.cosine_min:.4f}; relative error mean "
                   f"{hidden.relative_error_mean:.4f}; mean-pooled embedding cosine min {hidden.pooled_cosine_min:.5f}")
    return result


def plot_report(report: dict, path: Path) -> None:
    """PNG: per-tensor SNR by layer and projection, and the greedy/KLD numbers in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensors = report.get("tensors") or {}
    fig, ax = plt.subplots(figsize=(12, 5))
    kinds: dict[str, list[tuple[int, float]]] = {}
    for position, (module, stats) in enumerate(tensors.items()):
        parts = module.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), -1)
        kinds.setdefault(parts[-1], []).append((layer, stats["snr_db"] if stats["snr_db"] is not None else float("nan")))
    for kind, points in sorted(kinds.items()):
        points.sort()
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", linestyle="-" if len(points) > 1 else "none", label=kind)
    ax.set_xlabel("decoder layer (-1: not in a layer)")
    ax.set_ylabel("SNR of the dequantized weight (dB)")
    title = f"{report['checkpoint']}: {'PASS' if report['ok'] else 'FAIL'}"
    fid = report.get("fidelity")
    if fid:
        title += (f" | KLD {fid['kld_mean']:.4f}, top-1 {100 * fid['top1_agreement']:.1f}%, "
                  f"ppl ratio {fid['ppl_ratio']:.3f}, greedy {fid['greedy_matches']}/{fid['greedy_total']}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
