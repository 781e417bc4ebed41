#!/usr/bin/env bash
# A separate environment with the tools users quantize with (GPTQModel 7.6, llm-compressor), for
# benchmarks/make_quantized_sources.py only: they are never int4q dependencies. torch is pinned
# first (an unpinned one pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-producers}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q gptqmodel==7.6.0 llmcompressor
