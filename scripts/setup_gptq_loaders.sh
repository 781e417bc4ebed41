#!/usr/bin/env bash
# A separate environment with the GPTQ loaders users run (GPTQModel 7.6 and transformers' GPTQ
# route through optimum), for benchmarks/gptq_loaders.py only: they are never int4q dependencies.
# torch is pinned first (an unpinned one pulls a CUDA build); transformers matches int4q's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gptq-loaders}
TRANSFORMERS=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
.venv/bin/python -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "transformers==$TRANSFORMERS" optimum gptqmodel==7.6.0 click tqdm
