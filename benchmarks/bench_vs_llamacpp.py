"""int4q against llama.cpp on the same machine, in one process, arms interleaved per rep.

Every arm runs the same lengths with the same thread count: pp = one forward over N prompt
tokens into an empty cache; tg = M single-token steps after a 1-token prompt (llama-bench's
definitions). int4q arms decode the way ``int4q generate`` does (fast decoder, compiled step);
llama.cpp arms run through llama-cpp-python, an optional extra (``pip install int4q[bench]``;
where the CPU advertises AMX that the kernel does not enable, build it with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"``).

    python benchmarks/bench_vs_llamacpp.py --int4 models/g64 --int4 models/g32 --bf16 models/bf16 \\
        --gguf q4_1=<path> --make-q4_0 --threads 2 --json out.json

With ``--int8`` each int4q checkpoint is also measured with int8 activations (arm ``<name>+int8``;
the plain arm is exact). ``--llama-bench LABEL=BINARY`` (repeatable) also runs each GGUF through
that build's own ``llama-bench`` (arm ``<gguf>@<LABEL>``), e.g. the native and the portable builds of
``scripts/setup_gguf.sh --build`` / ``--build-portable``, so a build choice never hides a faster
llama.cpp.

``--bench-flags LABEL="FLAGS"`` gives that build's runs extra llama-bench flags, e.g. an
ik_llama.cpp build's best settings on a CPU (``ik="-rtr 1 -fa 1"``); any llama.cpp fork with a
``llama-bench`` runs this way, found by its path (int4q neither ships nor builds one).
``--depth D`` decodes after D tokens of context in every arm (llama-bench's ``-d``).

With ``--ttft`` it also times ``int4q generate`` twice in fresh processes: cold (empty compile
caches) and warm (reusing what the first run saved).
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

from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.bench import (
    decode_tokens_per_s,
    describe_path,
    load_measured,
    prefill_tokens_per_s,
)
from quantizer.runtime.decode.opening import open_decoder
from quantizer.runtime.loader import import_architecture

Q4_0_FTYPE = 2  # LLAMA_FTYPE_MOSTLY_Q4_0


class TorchArm:
    def __init__(self, label: str, path: str, pp: int, tg: int, activations: Activations | None = None,
                 depth: int = 0):
        self.model, measured = load_measured(lambda p: load_model(p, activations=activations), path, label)
        self.rss_mb, self.depth = measured.load_rss_anon_mb, depth
        started = time.perf_counter()
        self.decoder = open_decoder(self.model, max(pp, depth, 1) + tg + 1)
        self.label, self.kind, self.open_s = label, f"int4q ({describe_path(self.decoder)})", time.perf_counter() - started

    def pp(self, n: int) -> float:
        return prefill_tokens_per_s(self.model, n, self.decoder)

    def tg(self, n: int) -> float:
        return decode_tokens_per_s(self.model, n, self.decoder, self.depth)


class LlamaCppArm:
    def __init__(self, label: str, path: str, pp: int, tg: int, threads: int, depth: int = 0):
        import llama_cpp

        def load(gguf):
            return llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                                   n_ctx=max(pp, depth, 1) + tg + 8, n_batch=max(pp, depth, 1), use_mmap=False,
                                   verbose=False)

        self.llm, measured = load_measured(load, path, label)
        self.rss_mb = measured.load_rss_anon_mb
        self.label, self.kind, self.open_s, self.depth = label, "llama.cpp", 0.0, depth
        self.vocab = self.llm.n_vocab()

    def pp(self, n: int) -> float:
        tokens = [100 + (i * 7919) % (self.vocab - 200) for i in range(n)]
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        return n / (time.perf_counter() - start)

    def tg(self, n: int) -> float:
        self.llm.reset()
        self.llm.eval([100 + (i * 7919) % (self.vocab - 200) for i in range(max(self.depth, 1))])
        start = time.perf_counter()
        for i in range(n):
            self.llm.eval([101 + i])
        return n / (time.perf_counter() - start)


class LlamaBenchArm:
    """One GGUF through a llama.cpp build's own ``llama-bench`` (a process per rep, one repetition each)."""

    def __init__(self, label: str, binary: str, path: str, threads: int, flags: tuple[str, ...] = (), depth: int = 0):
        self.label, self.kind = label, f"llama-bench {Path(binary).parent.parent.name}"
        if flags:
            self.kind += " " + " ".join(flags)
        self.open_s, self.rss_mb = 0.0, 0.0
        self.binary, self.path, self.threads, self.flags, self.depth = binary, path, threads, flags, depth
        usage = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
        self.depth_option = "-d" if "-d, --n-depth" in usage else "-gp" if "-gp <pp,tg>" in usage else None
        if depth and self.depth_option is None:
            sys.exit(f"{binary} has neither -d nor -gp: it cannot decode at a depth")

    def _run(self, pp: int, tg: int, depth: int = 0) -> float:
        if depth and self.depth_option == "-gp":  # ik_llama.cpp: tg tokens after a pp-token prompt
            lengths = ["-p", "0", "-n", "0", "-gp", f"{depth},{tg}"]
        else:
            lengths = ["-p", str(pp), "-n", str(tg), *(["-d", str(depth)] if depth else [])]
        done = subprocess.run([self.binary, "-m", self.path, "-t", str(self.threads), *lengths, *self.flags, "-r", "1",
                               "-o", "json"], capture_output=True, text=True, check=True)
        return float(json.loads(done.stdout)[0]["avg_ts"])

    def pp(self, n: int) -> float:
        return self._run(n, 0)

    def tg(self, n: int) -> float:
        return self._run(0, n, self.depth)


def make_q4_0(source: Path) -> Path:
    """Requantize a GGUF to Q4_0 with llama.cpp's own quantizer (speed arm: same model, Q4_0 blocks),
    kept in the temp folder under a name that says which source and which size it came from."""
    import llama_cpp

    out = Path(tempfile.gettempdir()) / f"int4q-bench-{source.stem}-{source.stat().st_size}.q4_0.gguf"
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_0_FTYPE
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama.cpp could not requantize {source}")
    partial.rename(out)
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int4", action="append", default=[], help="int4q checkpoint folder (repeatable)")
    ap.add_argument("--bf16", help="bf16 checkpoint folder, run through the same int4q runtime")
    ap.add_argument("--gguf", action="append", default=[], help="LABEL=PATH of a GGUF for llama.cpp (repeatable)")
    ap.add_argument("--make-q4_0", action="store_true", help="also requantize the first GGUF to Q4_0")
    ap.add_argument("--int8", action="store_true", help="also run each --int4 with int8 activations")
    ap.add_argument("--llama-bench", action="append", default=[],
                    help="LABEL=BINARY: also run every GGUF through this llama.cpp build's llama-bench (repeatable)")
    ap.add_argument("--bench-flags", action="append", default=[],
                    help='LABEL="FLAGS": extra llama-bench flags for that --llama-bench build, e.g. ik="-rtr 1 -fa 1"')
    ap.add_argument("--depth", type=int, default=0, help="decode after this many tokens of context (llama-bench -d)")
    ap.add_argument("--no-python-llama", action="store_true",
                    help="run GGUFs only through --llama-bench, not through llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ttft", action="store_true", help="time cold and warm starts of int4q generate")
    ap.add_argument("--bandwidth", action="store_true",
                    help="measure read bandwidth and report the fraction each arm's decode reaches")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ggufs = [tuple(g.split("=", 1)) for g in args.gguf]
    if args.make_q4_0 and ggufs:
        ggufs.append(("q4_0", str(make_q4_0(Path(ggufs[0][1])))))
    if args.int4 or args.bf16:  # one-time imports and allocations are not charged to the first arm
        import_architecture(args.int4[0] if args.int4 else args.bf16)
    exact, int8 = EXACT, Activations("int8", "int8")
    arms = [TorchArm(Path(p).name, p, args.pp, args.tg, exact, args.depth) for p in args.int4]
    arms += [TorchArm(Path(p).name + "+int8", p, args.pp, args.tg, int8, args.depth) for p in args.int4 if args.int8]
    if args.bf16:
        arms.append(TorchArm("bf16", args.bf16, args.pp, args.tg, depth=args.depth))
    if not args.no_python_llama:
        arms += [LlamaCppArm(label, path, args.pp, args.tg, args.threads, args.depth) for label, path in ggufs]
    builds = [tuple(b.split("=", 1)) for b in args.llama_bench]
    flags = {label: tuple(shlex.split(text)) for label, text in (f.split("=", 1) for f in args.bench_flags)}
    arms += [LlamaBenchArm(f"{label}@{build}", binary, path, args.threads, flags.get(build, ()), args.depth)
             for build, binary in builds for label, path in ggufs]
    for arm in arms:  # warm-up
        arm.pp(min(args.pp, 32) or 1)
        arm.tg(4)
    results = {arm.label: {"pp": [], "tg": []} for arm in arms}
    for rep in range(args.reps):
        for arm in arms:
            if args.pp:
                results[arm.label]["pp"].append(arm.pp(args.pp))
            results[arm.label]["tg"].append(arm.tg(args.tg))
            print(f"rep {rep + 1}/{args.reps} {arm.label}: pp {results[arm.label]['pp'][-1] if args.pp else 0:.1f} "
                  f"tg {results[arm.label]['tg'][-1]:.1f} tok/s", file=sys.stderr)
    report = {"threads": args.threads, "pp": args.pp, "tg": args.tg, "depth": args.depth, "reps": args.reps,
              "torch": torch.__version__, "arms": {}}
    for arm in arms:
        r = results[arm.label]
        report["arms"][arm.label] = {
            "kind": arm.kind, "pp_median": round(statistics.median(r["pp"]), 1) if r["pp"] else None,
            "tg_median": round(statistics.median(r["tg"]), 1), "tg_reps": [round(v, 1) for v in r["tg"]],
            "rss_anon_after_load_mb": round(arm.rss_mb, 1), "open_s": round(arm.open_s, 2),
        }
    reference = next((arm.label for arm in arms if isinstance(arm, (LlamaCppArm, LlamaBenchArm))), None)
    print(f"threads {args.threads}, pp{args.pp} tg{args.tg}, {args.reps} reps, medians; ratio = tg / tg of {reference}")
    print(f"{'arm':<14} {'runtime':<20} {'pp tok/s':>9} {'tg tok/s':>9} {'tg ratio':>9} {'RssAnon MiB':>12}")
    for label, a in report["arms"].items():
        ratio = a["tg_median"] / report["arms"][reference]["tg_median"] if reference else float("nan")
        a["tg_ratio_vs_" + str(reference)] = round(ratio, 3)
        print(f"{label:<14} {a['kind']:<20} {a['pp_median'] or 0:>9.1f} {a['tg_median']:>9.1f} {ratio:>9.2f} "
              f"{a['rss_anon_after_load_mb']:>12.1f}")
    if args.bandwidth:
        gbs = read_bandwidth_gbs()
        report["read_bandwidth_gbs"] = round(gbs, 2)
        print(f"measured read bandwidth ({args.threads} threads): {gbs:.1f} GB/s")
        paths = {Path(p).name: p for p in args.int4} | {Path(p).name + "+int8": p for p in args.int4}
        paths |= {"bf16": args.bf16} if args.bf16 else {}
        for label, a in report["arms"].items():
            gguf = dict(ggufs).get(label.split("@")[0])
            nbytes = decode_bytes_gguf(gguf) if gguf else decode_bytes_int4q(paths[label])
            a["decode_bytes_per_token"] = nbytes
            a["bandwidth_fraction"] = round(nbytes * a["tg_median"] / 1e9 / gbs, 3)
            print(f"{label:<14} reads {nbytes / 1e6:8.1f} MB per token: {nbytes * a['tg_median'] / 1e9:5.2f} GB/s, "
                  f"{100 * a['bandwidth_fraction']:.0f}% of measured bandwidth")
    if args.ttft and args.int4:
        report["time_to_first_token"] = time_to_first_token(args.int4[0], args.threads)
        for name, run in report["time_to_first_token"].items():
            print(f"{name} start of int4q generate ({args.int4[0]}): {run['stats']}; process wall {run['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
