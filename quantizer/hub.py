"""The Hugging Face Hub (or any server speaking its API): fetch a model to quantize, and publish a
quantized folder with a generated model card. The token is passed to huggingface_hub and never
printed or written."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError, Int4qError
from .formats import RUNTIME_FORMAT, format_of_config, get_format

log = logging.getLogger(__name__)
CARD_NAME = "README.md"
METHOD_NAMES = {"gptq": "GPTQ", "minmax": "round-to-nearest on the min/max grid",
                "weighted": "round-to-nearest on activation-weighted grids"}
RETRIES = 3  # attempts for a push that fails on a connection error or a 5xx
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class PushError(Int4qError):
    """The server refused or could not be reached."""


@dataclass(frozen=True)
class UploadFile:
    path: str  # relative, POSIX
    size: int


def upload_files(folder: Path) -> list[UploadFile]:
    """What a push sends: every file under ``folder`` except hidden ones (partial runs, caches)."""
    files = []
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            files.append(UploadFile(rel.as_posix(), p.stat().st_size))
    return files


def check_publishable(folder: Path) -> None:
    """Raise InputError unless the folder is one verify would pass: its structural check passes
    (GPTQ-format exports: their shards are readable), its tokenizer loads, and a verify report
    saved in it, if any, says PASS."""
    from .checkpoint import CheckpointReader, read_config
    from .runtime import load_tokenizer
    from .verify import check_structure

    fmt = format_of_config(read_config(folder).get("quantization_config") or {})
    if fmt is not None and fmt.name != RUNTIME_FORMAT:
        CheckpointReader(folder)
    else:
        result, _ = check_structure(folder)
        if not result.ok:
            more = f" (and {len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
            raise InputError(f"{folder} fails verify's structural check: {result.problems[0]}{more}; "
                             "fix it or pass --no-verify")
    load_tokenizer(folder)
    report = _read_json(folder / "verify_report.json")
    if isinstance(report, dict):
        outcome = report.get("outcome") or ("PASS" if report.get("ok") else "FAIL")
        if outcome != "PASS":
            raise InputError(f"{folder}/verify_report.json says {outcome}; run int4q verify again once it passes, "
                             "or pass --no-verify")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


PLOT_NAME = "verify_snr.png"  # verify --plot writes it; the card shows it when the folder has it


def model_card(folder: Path, repo_id: str) -> str:
    """README.md text: YAML front matter (``base_model`` only when it is a Hub id), what was done,
    bits per weight, verify's numbers beside the source's when a verify_report.json is present,
    the SNR plot when the folder has one, and how to run it."""
    folder = Path(folder)
    config = _read_json(folder / "config.json") or {}
    qc = config.get("quantization_config") or {}
    report = _read_json(folder / "quantization_report.json") or {}
    fmt = format_of_config(qc) or get_format(RUNTIME_FORMAT)
    method = (report.get("quantization_config") or {}).get("method") or qc.get("method", "minmax")
    base = report.get("base_model") or base_model_id(report.get("source_model") or "", config)
    tags = ["4-bit", "int4q", fmt.name] + (["gptq"] if method == "gptq" and fmt.name != "gptq" else [])
    front = ["---"] + ([f"base_model: {base}"] if base else [])
    front += ["library_name: int4q", "pipeline_tag: text-generation", "tags:"] + [f"- {t}" for t in tags]
    lines = [*front, "---", "", f"# {repo_id.split('/')[-1]}", "",
             f"A 4-bit group-wise quantization{f' of [`{base}`](https://huggingface.co/{base})' if base else ''}, "
             "made with int4q.", "", *_settings_table(fmt, method, qc, report)]
    lines += _fidelity_section(_read_json(folder / "verify_report.json") or {}, (folder / PLOT_NAME).is_file())
    lines += _usage_section(repo_id, fmt.name == RUNTIME_FORMAT)
    return "\n".join(lines) + "\n"


def _settings_table(fmt, method: str, qc: dict, report: dict) -> list[str]:
    summary, report_qc = report.get("summary", {}), report.get("quantization_config") or {}
    symmetric = report_qc.get("symmetric", qc.get("symmetric", qc.get("sym")))
    rows = [("format", fmt.description), ("method", METHOD_NAMES.get(method, method)),
            ("group size", qc.get("group_size")), ("grid", "symmetric" if symmetric else "asymmetric")]
    if report.get("recipe"):
        rows.append(("precision recipe", f"{report['recipe']} ({len(qc.get('modules') or {})} modules not "
                                         f"4-bit g{qc.get('group_size')})"))
    rows += [(label, summary[key]) for label, key in (("bits per weight (quantized tensors)", "bits_per_weight"),
                                                     ("bits per weight (whole model)", "whole_model_bits_per_weight"))
             if summary.get(key)]
    calib = qc.get("calibration") or report_qc.get("calibration") or {}
    if calib:
        rows.append(("calibration", f"{calib.get('nsamples')} x {calib.get('seqlen')} tokens of {calib.get('text')}"))
    return ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]


def _fidelity_section(verify: dict, has_plot: bool) -> list[str]:
    fid = verify.get("fidelity")
    if not fid:
        return []
    lines = ["", "## Fidelity (`int4q verify`)", "",
             f"Against the bf16 source on {fid['tokens_scored']} tokens of {fid['text']} (context {fid['ctx']}):", "",
             "| | bf16 source | this model |", "| --- | --- | --- |",
             f"| perplexity | {fid['ppl_reference']:.4f} | {fid['ppl_quantized']:.4f} (x{fid['ppl_ratio']:.4f}) |",
             f"| KLD to the source, mean / p99.9 | 0 | {fid['kld_mean']:.4f} / {fid['kld_p999']:.4f} |",
             f"| top-1 agreement with the source | 100% | {100 * fid['top1_agreement']:.2f}% |",
             f"| greedy continuations identical | {fid['greedy_total']}/{fid['greedy_total']} | "
             f"{fid['greedy_matches']}/{fid['greedy_total']} |"]
    if has_plot:
        lines += ["", f"![Per-tensor SNR and the KLD distribution]({PLOT_NAME})"]
    return lines


def _install_line() -> str:
    """How to install this int4q: from its published source when the package metadata names one."""
    from importlib import metadata

    try:
        urls = metadata.metadata("int4q").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        urls = []
    source = next((u.split(",", 1)[1].strip() for u in urls if u.lower().startswith(("source", "repository"))), None)
    if source:
        return f'pip install "int4q @ git+{source}"'
    return "pip install ./int4q  # from a checkout of int4q's source: it is not on PyPI"


def _usage_section(repo_id: str, runs_here: bool) -> list[str]:
    if not runs_here:
        return []
    return ["", "## Run it", "", "```bash", _install_line(), f"hf download {repo_id} --local-dir model",
            "int4q generate model --chat --prompt \"Hello!\"", "```", "",
            "With transformers (int4q registers its loader when imported):", "", "```python",
            "import quantizer  # registers the cpu_int4 format with transformers",
            "from transformers import pipeline", "",
            f"generate = pipeline(\"text-generation\", model=\"{repo_id}\")",
            "print(generate(\"Hello!\", max_new_tokens=40)[0][\"generated_text\"])", "```"]


def _describe(e: Exception, token: str | None) -> str:
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    if status == 401 and token is None:
        return "the server needs a token (401 Unauthorized); pass --token, set HF_TOKEN or run `hf auth login`"
    if status == 401:
        return "the server refused the token (401 Unauthorized); check --token or HF_TOKEN"
    if status == 403:
        return "the token may not write to this repository (403 Forbidden)"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"{first}" if status is None else f"HTTP {status}: {first}"


def _transient(e: Exception) -> bool:
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status is not None:
        return status >= 500 or status == 429
    return isinstance(e, (OSError, ConnectionError)) or type(e).__module__.startswith(("httpx", "httpcore"))


def push(folder: Path, repo_id: str, token: str | None, endpoint: str | None, private: bool,
         revision: str | None, commit_message: str | None, show_bars: bool = False) -> str:
    """Create the repository (existing is fine), write a model card if there is none, and upload
    the folder in one commit. Returns the commit URL."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    # huggingface_hub's upload bars (rate, ETA) on a terminal only; the CLI closes them before an error line.
    enable_progress_bars() if show_bars else disable_progress_bars()
    folder = Path(folder)
    card = folder / CARD_NAME
    wrote_card = not card.exists()
    if wrote_card:
        card.write_text(model_card(folder, repo_id))
    try:
        return _upload(folder, repo_id, token, endpoint, private, revision, commit_message)
    except BaseException:
        if wrote_card:  # a failed push leaves the folder as it was
            card.unlink(missing_ok=True)
        raise


def _upload(folder: Path, repo_id: str, token: str | None, endpoint: str | None, private: bool,
            revision: str | None, commit_message: str | None) -> str:
    """One commit with everything in ``folder``, retried on transient failures."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    last: Exception | None = None
    for attempt in range(1, RETRIES + 1):
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                     commit_message=commit_message or "Upload int4q checkpoint",
                                     ignore_patterns=[".*", "**/.*"])
            return info.commit_url
        except Exception as e:  # huggingface_hub raises its own and httpx's types
            last = e
            if not _transient(e) or attempt == RETRIES:
                break
            log.warning("push attempt %d failed (%s); retrying", attempt, _describe(e, token))
            time.sleep(2 ** (attempt - 1))
    raise PushError(f"push to {repo_id} failed: {_describe(last, token)}")


def resolve_token(token: str | None) -> str | None:
    """--token, else HF_TOKEN, else the token huggingface_hub has stored."""
    if token:
        return token
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    from huggingface_hub import get_token

    return get_token()


def looks_like_hub_id(name: str | None) -> bool:
    """``owner/name`` with Hub-legal characters and no local folder of that name."""
    return bool(name) and HUB_ID.fullmatch(name) is not None and not Path(name).exists()


def base_model_id(named: str, config: dict, explicit: str | None = None) -> str | None:
    """The Hub id of the model a quantization was made from, for the card's ``base_model``: the
    one given (``--base-model``), else ``--model`` when it was a Hub id, else the source config's
    ``_name_or_path`` when that is one; None when none is known (a local path is never one)."""
    if explicit and not looks_like_hub_id(explicit):
        raise InputError(f"--base-model {explicit}: not a Hub id (owner/name); give the id the source was downloaded as")
    for candidate in (explicit, named, config.get("_name_or_path")):
        if looks_like_hub_id(candidate):
            return candidate
    return None


def resolve_model_dir(model: str) -> Path:
    """A local folder as is; otherwise treat ``model`` as a Hub repo id and fetch its files."""
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{model} is a file; --model takes a model folder or a Hub repo id")
        return path
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise InputError(f"{model}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
            )
        )
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{model}: not a local folder and could not be fetched from the Hub ({reason})") from None
