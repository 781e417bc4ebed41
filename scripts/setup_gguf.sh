#!/usr/bin/env bash
# What --format gguf needs: llama.cpp's own converter (convert_hf_to_gguf.py's conversion/ package
# and its gguf-py writer), taken from the llama-cpp-python source distribution on PyPI, into
# .venv/share/int4q/llama.cpp; its gguf-py replaces PyPI's gguf in .venv (the converter needs its
# own). With --build, also llama.cpp's tools (llama-completion, -quantize, -imatrix, -perplexity,
# -bench) in .venv/share/int4q/llama.cpp/build/bin, for the tests that run the files and the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=.venv/share/int4q/llama.cpp
PIP=".venv/bin/pip -q --disable-pip-version-check"
if [ ! -f "$DEST/.version" ] || [ "$(cat "$DEST/.version")" != "$VERSION" ]; then
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    $PIP download --no-deps --no-binary :all: -d "$TMP" "llama-cpp-python==$VERSION"
    tar -xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" \
        --exclude="llama_cpp_python-$VERSION/vendor/llama.cpp/models" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    rm -rf "$DEST"
    mkdir -p "$(dirname "$DEST")"
    mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
    echo "$VERSION" > "$DEST/.version"
fi
$PIP install --no-deps "$DEST/gguf-py" 'sentencepiece>=0.2' 'numpy>=1.26'
if [ "${1:-}" = "--build" ]; then
    TOOLS="llama-completion llama-quantize llama-imatrix llama-perplexity llama-bench"
    LOG="$DEST/build.log"
    {
        cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="${GGML_NATIVE:-ON}" \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
        # shellcheck disable=SC2086
        cmake --build "$DEST/build" -j "$(nproc)" --target $TOOLS
    } > "$LOG" 2>&1 || { tail -40 "$LOG" >&2; echo "building llama.cpp failed; the whole log: $LOG" >&2; exit 1; }
    echo "llama.cpp tools in $DEST/build/bin"
fi
