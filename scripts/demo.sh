#!/usr/bin/env bash
# The main job on the bundled default model: bf16 checkpoint -> cpu_int4 -> (verify, generate).
set -euo pipefail
cd "$(dirname "$0")/.."
INT4Q=.venv/bin/int4q
$INT4Q bundled-model models/smollm2-135m-bf16
$INT4Q quantize --model models/smollm2-135m-bf16 --out models/smollm2-135m-int4-g64 --group-size 64 --overwrite
$INT4Q verify models/smollm2-135m-int4-g64 --reference models/smollm2-135m-bf16 \
    --json models/smollm2-135m-int4-g64/verify_report.json --plot models/smollm2-135m-int4-g64-snr.png
$INT4Q generate models/smollm2-135m-int4-g64 --chat --prompt "What is the capital of France?" --max-new-tokens 40
