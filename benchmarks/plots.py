"""The benchmark pages' plots, made from the JSON the benchmark scripts write (``--json``).

    python benchmarks/plots.py --gguf docs/benchmarks/data/gguf_smollm2.json \
        --speed docs/benchmarks/data/speed_smollm2.json --gptq docs/benchmarks/data/gptq_smollm2.json \
        --out docs/benchmarks/img

Each input is optional; each one given makes its PNG: ``gguf_kld.png`` (or ``--gguf-png``: mean
KLD against bits per weight, one line per quantizer, from bench_gguf.py; with its --llama-types and
--targets arms, the Pareto plot), ``speed.png`` (prefill and decode tok/s per
engine, from bench_vs_llamacpp.py), ``gptq_phases.png`` (GPTQ's time per phase, from bench_gptq.py), ``decode_depth.png`` (or
``--depth-png``: decode tok/s against context depth per arm, from bench_vs_llamacpp.py --json files).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def quantizer_of(arm: str) -> str:
    """bench_gguf.py's arm label without its type: the quantizer and how it was calibrated."""
    words = arm.split()
    return " ".join(w for i, w in enumerate(words) if i != 1) if len(words) > 1 else arm


def plot_gguf(rows: list[dict], out: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_quantizer: dict[str, list[dict]] = {}
    for row in rows:
        if "kld" in row:
            by_quantizer.setdefault(quantizer_of(row["arm"]), []).append(row)
    for i, (name, points) in enumerate(sorted(by_quantizer.items())):
        points.sort(key=lambda r: r["bpw"])
        marker = "o" if name.startswith("int4q") else "s"
        ax.plot([p["bpw"] for p in points], [p["kld"] for p in points], marker=marker, linestyle="-" if
                len(points) > 1 else "none", label=name)
        for p in points:
            ax.annotate(p["arm"].split()[1], (p["bpw"], p["kld"]), fontsize=7, textcoords="offset points",
                        xytext=(4, 3))
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (whole file)")
    ax.set_ylabel("mean KLD against bf16 (log)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_speed(report: dict, out: Path, title: str) -> None:
    arms = report["arms"]
    labels = list(arms)
    names = [f"{label}\n{arms[label]['kind']}" for label in labels]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, what in ((axes[0], "pp_median", f"prefill pp{report['pp']}"),
                          (axes[1], "tg_median", f"decode tg{report['tg']}")):
        values = [arms[label][key] or 0 for label in labels]
        bars = ax.barh(names, values, color=["tab:blue" if "llama" not in arms[label]["kind"] else "tab:gray"
                                              for label in labels])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xlabel("tokens/s (median)")
        ax.set_title(what)
        ax.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_gptq(result: dict, out: Path, title: str) -> None:
    phases = {name: p["seconds"] for name, p in result["phases"].items()}
    phases["other"] = max(result["seconds"] - sum(phases.values()), 0.0)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.barh(list(phases), list(phases.values()), color="tab:blue")
    ax.bar_label(bars, fmt="%.1f s", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{title}: {result['seconds']:.0f} s in all, peak RSS {result['peak_rss_mb']} MiB")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def depth_points(report: dict, arm: dict) -> list[tuple[int, float]]:
    """(depth, decode tok/s) of one arm: every depth of a sweep, or the report's one depth."""
    if isinstance(arm.get("tg"), dict):
        return [(int(depth), tps) for depth, tps in arm["tg"].items()]
    return [(report.get("depth", 0), arm["tg_median"])]


def plot_depth(reports: list[dict], out: Path, title: str) -> None:
    series: dict[str, list[tuple[int, float]]] = {}
    for report in reports:
        for label, arm in report["arms"].items():
            series.setdefault(f"{label} ({arm['kind']})", []).extend(depth_points(report, arm))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([d for d, _ in points], [t for _, t in points], marker="o", label=name)
    ax.set_xlabel("context depth (tokens before the decode steps)")
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="bench_gguf.py --json output")
    ap.add_argument("--speed", type=Path, help="bench_vs_llamacpp.py --json output")
    ap.add_argument("--gptq", type=Path, help="bench_gptq.py --json output")
    ap.add_argument("--depth-series", type=Path, nargs="+",
                    help="bench_vs_llamacpp.py --json outputs: one with several --depth, or one per depth")
    ap.add_argument("--depth-png", default="decode_depth.png", help="the --depth-series plot's file name")
    ap.add_argument("--gguf-png", default="gguf_kld.png", help="the --gguf plot's file name")
    ap.add_argument("--model", default="SmolLM2-135M", help="the model's name for the titles")
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gguf:
        plot_gguf(json.loads(args.gguf.read_text()), args.out / args.gguf_png, f"{args.model}: GGUF quality per bit")
    if args.speed:
        plot_speed(json.loads(args.speed.read_text()), args.out / "speed.png", f"{args.model}: int4q and llama.cpp")
    if args.gptq:
        plot_gptq(json.loads(args.gptq.read_text()), args.out / "gptq_phases.png", f"{args.model} GPTQ")
    if args.depth_series:
        plot_depth([json.loads(p.read_text()) for p in args.depth_series], args.out / args.depth_png,
                   f"{args.model}: decode at depth")
    for png in sorted(args.out.glob("*.png")):
        print(png)


if __name__ == "__main__":
    main()
