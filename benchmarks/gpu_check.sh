#!/usr/bin/env bash
# GPTQ with --device cuda on a machine with an NVIDIA GPU: the CUDA test, then one model quantized
# on the GPU and on the CPU, each verified, with the times.
#
#     bash benchmarks/gpu_check.sh [MODEL_DIR]      # default: models/smollm2-135m-bf16, else a stand-in
#
# Uses the machine's python with torch (a CUDA build) and the repository on PYTHONPATH; wheels of
# missing packages in .whl/ are installed first into /tmp/site. Without MODEL_DIR or SmolLM2's
# folder it builds a SmolLM2-shaped stand-in with random weights (timings meaningful, KLD not).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} INT4Q_NATIVE=0 PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/int4q-gpu-check}
rm -rf "$WORK" && mkdir -p "$WORK"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
"$PY" -m pytest -q tests/quantize/test_cuda.py
MODEL=${1:-models/smollm2-135m-bf16}
if [ ! -f "$MODEL/config.json" ]; then
    MODEL=$WORK/standin
    "$PY" - "$MODEL" <<'PY'
import sys
from pathlib import Path
from conftest import save_byte_tokenizer, save_tiny_llama
path = save_tiny_llama(Path(sys.argv[1]), vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, shard=None)
save_byte_tokenizer(path)
PY
fi
for device in cuda cpu; do
    SECONDS=0
    "$PY" -m quantizer quantize --model "$MODEL" --out "$WORK/q-$device" --method gptq --device "$device" \
        --nsamples "${NSAMPLES:-128}" --seqlen "${SEQLEN:-512}" --group-size 64 --no-progress
    echo "$device: quantized in $SECONDS s"
    "$PY" -m quantizer verify "$WORK/q-$device" --model "$MODEL" --max-windows 8
done
