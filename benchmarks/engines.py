"""The engines bench_vs_llamacpp.py times side by side, each as an arm with the same two questions:
``pp(n)``, prefill tok/s of one forward over n prompt tokens into an empty cache, and
``tg(n, depth)``, decode tok/s of n single-token steps after a ``depth``-token context (1 token at
depth 0; the context's prefill is not timed), llama-bench's definitions.

- :class:`TorchArm`: an int4q (or bf16) checkpoint through int4q's runtime, decoding the way
  ``int4q generate`` does (fast decoder, compiled or native step).
- :class:`LlamaCppArm`: a GGUF through llama-cpp-python (the ``bench`` extra).
- :class:`LlamaBenchArm`: a GGUF through any llama.cpp build's own ``llama-bench`` (mainline or a
  fork such as ik_llama.cpp, found by its path; one process per measurement).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quantizer.runtime import load_model
from quantizer.runtime.activations import Activations
from quantizer.runtime.bench import (
    decode_tokens_per_s,
    describe_path,
    load_measured,
    prefill_tokens_per_s,
)
from quantizer.runtime.decode.opening import open_decoder

Q4_0_FTYPE = 2  # LLAMA_FTYPE_MOSTLY_Q4_0


def failure_line(done: subprocess.CompletedProcess) -> str:
    """A failed llama.cpp tool's own reason: its first line that says error, else its last."""
    lines = done.stderr.strip().splitlines() or ["(no output)"]
    return next((line.strip() for line in lines if "error" in line.lower()), lines[-1].strip())


def run_tool(binary: str, *args: str) -> subprocess.CompletedProcess:
    """A llama.cpp tool's run, its output captured; SystemExit with :func:`failure_line` where it fails. It
    runs in a temporary folder of its own, since some builds write a log file into the working folder;
    ``binary`` and any argument naming an existing path are made absolute for it."""
    argv = [os.path.abspath(a) if os.path.exists(a) else a for a in (binary, *args)]
    with tempfile.TemporaryDirectory(prefix="int4q-peer-") as folder:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=folder)
    if done.returncode:
        raise SystemExit(f"{binary} failed (exit {done.returncode}): {failure_line(done)}")
    return done


def spread_tokens(n: int, vocab: int) -> list[int]:
    """n token ids spread over the vocabulary (the same for every llama.cpp arm)."""
    return [100 + (i * 7919) % (vocab - 200) for i in range(n)]


class TorchArm:
    """``longest``: the most positions any measurement needs (the decoder's cache is opened once)."""

    def __init__(self, label: str, path: str, longest: int, activations: Activations | None = None,
                 kv_cache: str = "bf16"):
        self.model, measured = load_measured(lambda p: load_model(p, activations=activations), path, label)
        self.rss_mb = measured.load_rss_anon_mb
        started = time.perf_counter()
        self.kv_cache = kv_cache
        self.decoder = open_decoder(self.model, longest + 1, kv_cache=kv_cache)
        self.label, self.kind, self.open_s = label, f"int4q ({describe_path(self.decoder)})", time.perf_counter() - started

    def pp(self, n: int) -> float:
        return prefill_tokens_per_s(self.model, n, self.decoder)

    def tg(self, n: int, depth: int = 0) -> float:
        return decode_tokens_per_s(self.model, n, self.decoder, depth)


class LlamaCppArm:
    def __init__(self, label: str, path: str, longest: int, threads: int):
        import llama_cpp

        def load(gguf):
            return llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=longest + 8,
                                   n_batch=longest, use_mmap=False, verbose=False)

        self.llm, measured = load_measured(load, path, label)
        self.rss_mb = measured.load_rss_anon_mb
        self.label, self.kind, self.open_s = label, "llama.cpp", 0.0
        self.vocab = self.llm.n_vocab()

    def pp(self, n: int) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(spread_tokens(n, self.vocab))
        return n / (time.perf_counter() - start)

    def tg(self, n: int, depth: int = 0) -> float:
        self.llm.reset()
        self.llm.eval(spread_tokens(max(depth, 1), self.vocab))
        start = time.perf_counter()
        for i in range(n):
            self.llm.eval([101 + i])
        return n / (time.perf_counter() - start)


class LlamaBenchArm:
    """One GGUF through a llama.cpp build's own ``llama-bench`` (a process per measurement, one
    repetition each), with that build's extra ``flags``."""

    def __init__(self, label: str, binary: str, path: str, threads: int, flags: tuple[str, ...] = ()):
        self.label, self.kind = label, " ".join(("llama-bench", *flags))
        self.open_s, self.rss_mb = 0.0, 0.0
        self.binary, self.path, self.threads, self.flags = binary, path, threads, flags
        usage = subprocess.run([binary, "--help"], check=False, capture_output=True, text=True).stdout
        self.depth_option = "-d" if "-d, --n-depth" in usage else "-gp" if "-gp <pp,tg>" in usage else None

    def check_depth(self, depth: int) -> None:
        if depth and self.depth_option is None:
            sys.exit(f"{self.binary} has neither -d nor -gp: it cannot decode at a depth")

    def _run(self, pp: int, tg: int, depth: int = 0) -> float:
        if depth and self.depth_option == "-gp":  # ik_llama.cpp: tg tokens after a pp-token prompt, tg timed
            lengths = ["-p", "0", "-n", "0", "-gp", f"{depth},{tg}"]
        else:
            lengths = ["-p", str(pp), "-n", str(tg), *(["-d", str(depth)] if depth else [])]
        done = run_tool(self.binary, "-m", self.path, "-t", str(self.threads), *lengths, *self.flags, "-r", "1",
                        "-o", "json")
        return float(json.loads(done.stdout)[0]["avg_ts"])

    def pp(self, n: int) -> float:
        return self._run(n, 0)

    def tg(self, n: int, depth: int = 0) -> float:
        return self._run(0, n, depth)


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
