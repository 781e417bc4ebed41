"""The model card a push writes when the folder has none: what was done, how well, how to run it."""

from __future__ import annotations

import json
from pathlib import Path

from ..formats import RUNTIME_FORMAT, format_of_config, get_format
from ..io.source import base_model_id
from ..methods import METHODS, UNCALIBRATED

CARD_NAME = "README.md"


def read_json(path: Path) -> dict | None:
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
    config = read_json(folder / "config.json") or {}
    qc = config.get("quantization_config") or {}
    report = read_json(folder / "quantization_report.json") or {}
    fmt = format_of_config(qc) or get_format(RUNTIME_FORMAT)
    method = (report.get("quantization_config") or {}).get("method") or qc.get("method", UNCALIBRATED)
    base = report.get("base_model") or base_model_id(report.get("source_model") or "", config)
    tags = ["4-bit", "int4q", fmt.name] + (["gptq"] if method == "gptq" and fmt.name != "gptq" else [])
    front = ["---"] + ([f"base_model: {base}"] if base else [])
    front += ["library_name: int4q", "pipeline_tag: text-generation", "tags:"] + [f"- {t}" for t in tags]
    lines = [*front, "---", "", f"# {repo_id.split('/')[-1]}", "",
             f"A 4-bit group-wise quantization{f' of [`{base}`](https://huggingface.co/{base})' if base else ''}, "
             "made with int4q.", "", *_settings_table(fmt, method, qc, report)]
    lines += _fidelity_section(read_json(folder / "verify_report.json") or {}, (folder / PLOT_NAME).is_file())
    lines += _usage_section(repo_id, fmt.name == RUNTIME_FORMAT)
    return "\n".join(lines) + "\n"


def _settings_table(fmt, method: str, qc: dict, report: dict) -> list[str]:
    summary, report_qc = report.get("summary", {}), report.get("quantization_config") or {}
    symmetric = report_qc.get("symmetric", qc.get("symmetric", qc.get("sym")))
    rows = [("format", fmt.description), ("method", METHODS[method].title if method in METHODS else method),
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
            "import quantizer.integrations.transformers  # registers the cpu_int4 format",
            "from transformers import pipeline", "",
            f"generate = pipeline(\"text-generation\", model=\"{repo_id}\")",
            "print(generate(\"Hello!\", max_new_tokens=40)[0][\"generated_text\"])", "```"]
