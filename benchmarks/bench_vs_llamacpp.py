"""int4q against llama.cpp and its forks on the same machine, in one process, arms interleaved per rep.

Every arm runs the same lengths with the same thread count (llama-bench's definitions, see
engines.py): ``--pp N...`` one forward over N prompt tokens into an empty cache; ``--tg M`` single-
token steps after ``--depth D...`` tokens of context (llama-bench's ``-d``; a fork without it, such
as ik_llama.cpp, gets ``-gp D,M``, which also times only the M steps). Each rep measures every
(length, arm) pair in turn, so drift shows in every arm alike; the report gives medians.

    python benchmarks/bench_vs_llamacpp.py --int4 models/g64 --int8 --gguf q4_0=<path> --no-python-llama \
        --llama-bench llama=<llama.cpp build>/bin/llama-bench --llama-bench ik=<ik_llama.cpp build>/bin/llama-bench \
        --bench-flags ik="-rtr 1 -fa 1" --pp 512 2048 --depth 0 2048 4096 8192 --tg 64 --bandwidth --json out.json

int4q arms: each ``--int4`` with exact activations, and with ``--int8`` also with int8 activations
(arm ``<name>+int8``; ``--skip-exact`` keeps only those), and with ``--kv-int8`` those again over an
int8 KV cache (arm ``<name>+int8+kv8``); ``--bf16`` a bf16 checkpoint through the same runtime.
llama.cpp arms: each ``--gguf`` through llama-cpp-python (the ``bench`` extra;
``--no-python-llama`` skips it) and through every ``--llama-bench LABEL=BINARY`` (arm
``<gguf>@<LABEL>``), with that build's ``--bench-flags LABEL="FLAGS"`` (e.g. ik_llama.cpp's best
CPU settings, ``-rtr 1 -fa 1``; mainline's flash attention defaults to auto). int4q neither ships
nor builds any of them. ``--make-q4_0`` requantizes the first GGUF to Q4_0.

``--bandwidth`` measures read bandwidth and reports the fraction each arm's decode reaches: the
weights a step reads plus the KV cache at the decode's mean position (bf16/f16 keys and values,
every layer attending to all of it; from the first int4q or bf16 checkpoint's config; an int8 cache's
codes and scales for ``+kv8`` arms, and q8_0 blocks for a llama-bench arm whose flags ask for
``-ctk q8_0 -ctv q8_0``). With
``--ttft`` it also times ``int4q generate`` twice in fresh processes: cold (empty compile caches)
and warm (reusing what the first run saved).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from engines import LlamaBenchArm, LlamaCppArm, TorchArm, make_q4_0

from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.loader import import_architecture


def read_bandwidth_gbs(gib: float = 1.0) -> float:
    """Best of 5 at summing an fp32 buffer far larger than the caches, with the benchmark's threads (GB/s)."""
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def decode_bytes_int4q(path: str) -> int:
    """Bytes one decode step reads: every tensor but an untied vocabulary table (one row is looked up)."""
    from quantizer.io.checkpoint import CheckpointReader, read_config
    from quantizer.io.structure import inspect_structure, tie_word_embeddings

    config = read_config(Path(path))
    structure = inspect_structure(config)
    infos = CheckpointReader(Path(path)).infos
    table = structure.embedding if not tie_word_embeddings(config) else None
    return sum(i.nbytes for n, i in infos.items() if not (table and n.startswith(table + ".")))


def decode_bytes_gguf(path: str) -> int:
    """Bytes one decode step reads from a GGUF: every tensor but token_embd when there is an output head."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


KV_BYTES = {"bf16": lambda dim: 2 * dim, "int8": lambda dim: dim + 2 * (dim // 32) + 2,
            "q8_0": lambda dim: dim // 32 * 34}
"""Bytes of one cached row (one position of one head) of ``dim`` values, by cache type, the mean of
a key's and a value's: int4q's int8 keys carry an fp32 scale per 32 values and its values one a
row; llama.cpp's q8_0 blocks of 32 an fp16 one."""


def kv_bytes_per_position(model_dir: str, kind: str = "bf16") -> int:
    """Bytes of keys and values one position adds to a cache of :data:`KV_BYTES` ``kind``, over every layer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * KV_BYTES[kind](dim)


def cache_kind(arm: dict) -> str:
    """The KV cache an arm of the report decodes over: int8 for int4q's ``+kv8`` arms, q8_0 for a
    llama-bench arm whose flags set both caches to q8_0, else bf16 (or f16, as many bytes)."""
    if arm["kv_cache"] == "int8":
        return "int8"
    flags = arm["kind"].split()
    pairs = dict(zip(flags, flags[1:]))
    return "q8_0" if pairs.get("-ctk") == pairs.get("-ctv") == "q8_0" else "bf16"


def time_to_first_token(model_dir: str, threads: int) -> dict:
    """``int4q generate --stats`` twice in fresh processes: with empty compile caches, then warm."""
    prompt = ["--prompt", "The capital of France is", "--max-new-tokens", "16", "--threads", str(threads), "--stats"]
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, INT4Q_CACHE_DIR=cache)  # int4q keeps Inductor's files under it too
        runs = {}
        for name in ("cold", "warm"):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "quantizer", "generate", model_dir, *prompt],
                                  env=env, capture_output=True, text=True, check=True)
            line = [ln for ln in done.stderr.splitlines() if "time to first token" in ln][-1]
            runs[name] = {"wall_s": round(time.perf_counter() - started, 2), "stats": line.removeprefix("int4q: ")}
    return runs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int4", action="append", default=[], help="int4q checkpoint folder (repeatable)")
    ap.add_argument("--bf16", help="bf16 checkpoint folder, run through the same int4q runtime")
    ap.add_argument("--gguf", action="append", default=[], help="LABEL=PATH of a GGUF for llama.cpp (repeatable)")
    ap.add_argument("--make-q4_0", action="store_true", help="also requantize the first GGUF to Q4_0")
    ap.add_argument("--int8", action="store_true", help="also run each --int4 with int8 activations")
    ap.add_argument("--skip-exact", action="store_true", help="with --int8: run each --int4 with int8 activations only")
    ap.add_argument("--kv-int8", action="store_true",
                    help="with --int8: also run each --int4 with int8 activations over an int8 KV cache")
    ap.add_argument("--llama-bench", action="append", default=[],
                    help="LABEL=BINARY: also run every GGUF through this llama.cpp build's llama-bench (repeatable)")
    ap.add_argument("--bench-flags", action="append", default=[],
                    help='LABEL="FLAGS": extra llama-bench flags for that --llama-bench build, e.g. ik="-rtr 1 -fa 1"')
    ap.add_argument("--depth", type=int, nargs="+", default=[0], help="decode after each of these context lengths")
    ap.add_argument("--no-python-llama", action="store_true",
                    help="run GGUFs only through --llama-bench, not through llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, nargs="+", default=[512], help="prefill lengths (0: none)")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ttft", action="store_true", help="time cold and warm starts of int4q generate")
    ap.add_argument("--bandwidth", action="store_true",
                    help="measure read bandwidth and report the fraction each arm's decode reaches")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.pp = [n for n in args.pp if n > 0]
    if any(d < 0 for d in args.depth) or args.tg < 1 or args.reps < 1:
        ap.error("--depth must be >= 0, --tg and --reps >= 1")
    if (args.skip_exact or args.kv_int8) and not args.int8:
        ap.error("--skip-exact and --kv-int8 need --int8")
    return args


def make_arms(args: argparse.Namespace) -> tuple[list, dict]:
    """The arms in the order each rep runs them, and the GGUFs by label."""
    ggufs = dict(g.split("=", 1) for g in args.gguf)
    if args.make_q4_0 and ggufs:
        ggufs["q4_0"] = str(make_q4_0(Path(next(iter(ggufs.values())))))
    if args.int4 or args.bf16:  # one-time imports and allocations are not charged to the first arm
        import_architecture(args.int4[0] if args.int4 else args.bf16)
    longest = max([*args.pp, *args.depth, 1]) + args.tg
    arms = [] if args.skip_exact else [TorchArm(Path(p).name, p, longest, EXACT) for p in args.int4]
    if args.int8:
        arms += [TorchArm(Path(p).name + "+int8", p, longest, Activations("int8", "int8")) for p in args.int4]
    if args.kv_int8:
        arms += [TorchArm(Path(p).name + "+int8+kv8", p, longest, Activations("int8", "int8"), "int8")
                 for p in args.int4]
    if args.bf16:
        arms.append(TorchArm("bf16", args.bf16, longest))
    if not args.no_python_llama:
        arms += [LlamaCppArm(label, path, longest, args.threads) for label, path in ggufs.items()]
    flags = {label: tuple(shlex.split(text)) for label, text in (f.split("=", 1) for f in args.bench_flags)}
    for build, binary in (b.split("=", 1) for b in args.llama_bench):
        for label, path in ggufs.items():
            arm = LlamaBenchArm(f"{label}@{build}", binary, path, args.threads, flags.get(build, ()))
            for depth in args.depth:
                arm.check_depth(depth)
            arms.append(arm)
    return arms, ggufs


def measure(arms: list, args: argparse.Namespace) -> dict:
    """Every arm's tok/s per rep: {label: {"pp": {n: [...]}, "tg": {depth: [...]}}}, arms interleaved."""
    for arm in arms:  # warm-up
        arm.pp(min([*args.pp, 32]) if args.pp else 1)
        arm.tg(4)
    results = {arm.label: {"pp": {n: [] for n in args.pp}, "tg": {d: [] for d in args.depth}} for arm in arms}
    for rep in range(args.reps):
        for n in args.pp:
            for arm in arms:
                results[arm.label]["pp"][n].append(arm.pp(n))
                print(f"rep {rep + 1}/{args.reps} {arm.label}: pp{n} {results[arm.label]['pp'][n][-1]:.1f} tok/s",
                      file=sys.stderr)
        for depth in args.depth:
            for arm in arms:
                results[arm.label]["tg"][depth].append(arm.tg(args.tg, depth))
                print(f"rep {rep + 1}/{args.reps} {arm.label}: tg{args.tg} at depth {depth} "
                      f"{results[arm.label]['tg'][depth][-1]:.1f} tok/s", file=sys.stderr)
    return results


def summarize(arms: list, results: dict, args: argparse.Namespace) -> dict:
    """The report: per arm its medians by length and depth (the first of each also as pp_median and
    tg_median), and each int4q arm's decode over the best llama.cpp arm's at every depth."""
    report = {"threads": args.threads, "pp": args.pp[0] if args.pp else 0, "pp_lengths": args.pp, "tg": args.tg,
              "depths": args.depth, "depth": args.depth[0], "reps": args.reps, "torch": torch.__version__, "arms": {}}
    for arm in arms:
        r = results[arm.label]
        pp = {n: round(statistics.median(v), 1) for n, v in r["pp"].items()}
        tg = {d: round(statistics.median(v), 1) for d, v in r["tg"].items()}
        report["arms"][arm.label] = {
            "kind": arm.kind, "peer": not isinstance(arm, TorchArm), "pp": pp, "tg": tg,
            "kv_cache": getattr(arm, "kv_cache", "bf16"),
            "pp_median": pp[args.pp[0]] if args.pp else None, "tg_median": tg[args.depth[0]],
            "tg_reps": {d: [round(x, 1) for x in v] for d, v in r["tg"].items()},
            "rss_anon_after_load_mb": round(arm.rss_mb, 1), "open_s": round(arm.open_s, 2),
        }
    peers = [a for a in report["arms"].values() if a["peer"]]
    for a in report["arms"].values():
        if peers and not a["peer"]:
            a["tg_over_best_peer"] = {d: round(a["tg"][d] / max(p["tg"][d] for p in peers), 3) for d in args.depth}
            if args.pp:
                a["pp_over_best_peer"] = {n: round(a["pp"][n] / max(p["pp"][n] for p in peers), 3) for n in args.pp}
    return report


def print_report(report: dict) -> None:
    lengths = [f"pp{n}" for n in report["pp_lengths"]] + [f"tg{report['tg']}@d{d}" for d in report["depths"]]
    print(f"threads {report['threads']}, {report['reps']} reps interleaved, medians (tok/s); "
          f"x best peer: int4q over the fastest llama.cpp arm at that length")
    print(f"{'arm':<18} {'runtime':<34} " + " ".join(f"{c:>12}" for c in lengths))
    for label, a in report["arms"].items():
        cells = [a["pp"][n] for n in report["pp_lengths"]] + [a["tg"][d] for d in report["depths"]]
        print(f"{label:<18} {a['kind'][:34]:<34} " + " ".join(f"{c:>12.1f}" for c in cells))
        over = [a.get("pp_over_best_peer", {}).get(n) for n in report["pp_lengths"]]
        over += [a.get("tg_over_best_peer", {}).get(d) for d in report["depths"]]
        if any(x is not None for x in over):
            print(f"{'  x best peer':<53} " + " ".join(f"{x:>11.2f}x" for x in over))


def add_bandwidth(report: dict, args: argparse.Namespace, ggufs: dict) -> None:
    """Each arm's decode bytes per token (weights, plus the KV cache at the decode's mean position
    where a checkpoint's config gives its size) and the fraction of measured read bandwidth."""
    gbs = read_bandwidth_gbs()
    report["read_bandwidth_gbs"] = round(gbs, 2)
    print(f"measured read bandwidth ({args.threads} threads): {gbs:.1f} GB/s")
    config_dir = args.int4[0] if args.int4 else args.bf16
    paths = {Path(p).name + suffix: p for p in args.int4 for suffix in ("", "+int8", "+int8+kv8")}
    paths |= {"bf16": args.bf16} if args.bf16 else {}
    for label, a in report["arms"].items():
        gguf = ggufs.get(label.split("@")[0])
        weights = decode_bytes_gguf(gguf) if gguf else decode_bytes_int4q(paths[label])
        per_position = kv_bytes_per_position(config_dir, cache_kind(a)) if config_dir else 0
        a["decode_weight_bytes"], a["bandwidth_fraction"] = weights, {}
        for depth in report["depths"]:
            nbytes = weights + per_position * (depth + report["tg"] // 2)
            a["bandwidth_fraction"][depth] = round(nbytes * a["tg"][depth] / 1e9 / gbs, 3)
        print(f"{label:<18} weights {weights / 1e6:7.1f} MB, KV {per_position / 1e3:.1f} kB a position: "
              + ", ".join(f"d{d} {100 * f:.0f}%" for d, f in a["bandwidth_fraction"].items()) + " of bandwidth")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    arms, ggufs = make_arms(args)
    report = summarize(arms, measure(arms, args), args)
    print_report(report)
    if args.bandwidth:
        add_bandwidth(report, args, ggufs)
    if args.ttft and args.int4:
        report["time_to_first_token"] = time_to_first_token(args.int4[0], args.threads)
        for name, run in report["time_to_first_token"].items():
            print(f"{name} start of int4q generate ({args.int4[0]}): {run['stats']}; process wall {run['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
