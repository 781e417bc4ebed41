"""int4q's Python API: :func:`quantize`, :func:`verify` and :func:`load`, each the call its CLI
command makes. Errors are :class:`quantizer.errors.Int4qError` subclasses whose message is one
line naming the fix; nothing here prints unless ``progress`` or ``say`` is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

SIZE = int | str


def quantize(model: str | Path, out: str | Path, *, format: str = "cpu_int4", method: str = "minmax",
             group_size: int | str = "auto", gguf_type: str | None = None, symmetric: bool | None = None,
             recipe: str = "all4", embedding_bits: int | None = None, head_bits: int | None = None,
             overrides: Sequence[str] = (), ignore: Sequence[str] = (), untie_head: bool = False,
             clip_search: bool = False, strict_group_size: bool = False, max_shard_size: SIZE = "2GB",
             overwrite: bool = False, base_model: str | None = None, calib: str | Path | None = None,
             nsamples: int | None = None, seqlen: int = 512, seed: int = 0, calib_precision: str = "auto",
             device: str = "cpu", act_order: bool = True, damp: float = 0.01, weighted_grids: bool = True,
             refine: bool = False, resume: bool = False, imatrix_out: str | Path | None = None,
             target_bpw: float | None = None, progress=None):
    """Quantize the checkpoint ``model`` (a folder or a Hub repo id) into ``out`` (a folder; for
    ``format="gguf"`` the ``.gguf`` file) and return its :class:`QuantizeReport` (None on a torchrun
    rank other than 0). The options are ``int4q quantize``'s, by the same names with underscores
    (``overrides``: ``"PATTERN=BITS[:GROUP]"`` strings; ``max_shard_size``: bytes or ``"2GB"``);
    ``progress``: a :class:`quantizer.quantization.run.Progress` to be told how the run goes."""
    from .calibrate.windows import CalibrationSettings
    from .io.shards import parse_size
    from .methods.gptq_method import GptqSettings
    from .quantization.planning import QuantizeOptions
    from .quantization.recipes import Override
    from .quantization.request import QuantizeRequest, checked_request
    from .quantization.run import Progress, quantize_checkpoint

    options = QuantizeOptions(
        group_size=_group_size(group_size), symmetric=symmetric, clip_search=clip_search,
        untie_head=untie_head, ignore=tuple(ignore),
        max_shard_bytes=max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size),
        method=method, checkpoint_format=format, recipe=recipe, embedding_bits=embedding_bits, head_bits=head_bits,
        overrides=tuple(Override.parse(o) for o in overrides), strict_group_size=strict_group_size,
        gguf_type=gguf_type, target_bpw=target_bpw)
    settings = GptqSettings(act_order=act_order, damp=damp, weighted_grids=weighted_grids, refine=refine) \
        if method == "gptq" else None
    windows = CalibrationSettings(nsamples, seqlen, seed, calibration_precision(calib_precision, device))
    request = QuantizeRequest(str(model), Path(out), options, overwrite, base_model,
                              Path(calib) if calib is not None else None, windows, settings, resume, device,
                              Path(imatrix_out) if imatrix_out is not None else None)
    return quantize_checkpoint(checked_request(request, refine), progress or Progress())


def _group_size(value: int | str) -> int | None:
    """``"auto"`` (None), or a whole number; UsageError otherwise."""
    from .errors import UsageError

    if value == "auto":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"group_size {value!r} is neither 'auto' nor a whole number (32, 64, 128 or 256)") from None


def calibration_precision(choice: str, device: str) -> str:
    """``calib_precision`` decided: ``auto`` is bf16 on a GPU, else what this CPU multiplies fastest."""
    if choice != "auto":
        return choice
    if device == "cuda":
        return "bf16"
    from .native.cpu import fast_matmul_precision

    return fast_matmul_precision()


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found: ``outcome`` PASS (every check ran and passed), FAIL (a check
    failed) or INCOMPLETE (a check could not run); ``summary_lines`` as the CLI prints them;
    ``numbers``: every measurement (per-tensor SNR, KLD, greedy agreement), as ``--json`` writes it."""

    outcome: str
    summary_lines: tuple[str, ...]
    numbers: dict = field(repr=False)

    @property
    def passed(self) -> bool:
        return self.outcome == "PASS"


def verify(path: str | Path, reference: str | Path | None = None, *, text: str | Path | None = None,
           ctx: int = 512, max_windows: int = 16, greedy_tokens: int = 32, max_kld: float | None = None,
           say: Callable[[str], None] | None = None) -> VerifyReport:
    """Check the cpu_int4 folder (or a .gguf file int4q wrote) at ``path``; with ``reference``, the
    checkpoint it was quantized from, also its round trip and end-to-end fidelity (KLD and
    perplexity over ``max_windows`` windows of ``ctx`` tokens of ``text``, default the held-out
    half of CPython's pydoc_data.topics; greedy agreement over ``greedy_tokens``). ``max_kld``
    fails a mean KLD above it; ``say`` receives progress lines."""
    from .errors import UsageError
    from .verification.run import run_verify

    if max_kld is not None and reference is None:
        raise UsageError("max_kld (--max-kld) needs a reference (--reference) to compare against")
    numbers = run_verify(Path(path), Path(reference) if reference is not None else None,
                         Path(text) if text is not None else None, ctx, max_windows, greedy_tokens, max_kld,
                         say=say or (lambda message: None))
    return VerifyReport(numbers["outcome"], tuple(numbers["summary_lines"]), numbers)


def load(path: str | Path, threads: int | None = None):
    """The cpu_int4 checkpoint at ``path`` as a transformers model whose linears run int4q's
    kernels (``model.generate`` works as for any transformers model); ``threads``: torch's
    intra-op threads. Its tokenizer: ``transformers.AutoTokenizer.from_pretrained(path)``."""
    from .runtime.loader import load_model

    return load_model(Path(path), threads=threads)
