#!/usr/bin/env bash
# What --format gguf needs: llama.cpp's own converter (convert_hf_to_gguf.py's conversion/ package
# and its gguf-py writer), taken from the llama-cpp-python source distribution on PyPI, into
# .venv/share/int4q/llama.cpp; its gguf-py replaces PyPI's gguf in .venv (the converter needs its
# own). With --build, also llama.cpp's tools (llama-completion, -quantize, -imatrix, -perplexity,
# -bench, -embedding) in .venv/share/int4q/llama.cpp/build/bin, for the tests that run the files and the bench;
# with --build-portable, the same tools built without -march=native in build-portable/bin.
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
build() {  # build folder, then cmake's CPU options
    local dir="$DEST/$1" log="$DEST/$1.log"
    shift
    TOOLS="llama-completion llama-quantize llama-imatrix llama-perplexity llama-bench llama-embedding"
    {
        cmake -S "$DEST" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF
        # shellcheck disable=SC2086
        cmake --build "$dir" -j "$(nproc)" --target $TOOLS
    } > "$log" 2>&1 || { tail -40 "$log" >&2; echo "building llama.cpp failed; the whole log: $log" >&2; exit 1; }
    echo "llama.cpp tools in $dir/bin"
}
case "${1:-}" in
    --build) build build -DGGML_NATIVE="${GGML_NATIVE:-ON}" ;;
    # the AVX-512 build a distributed binary would be: no -march=native, no AMX
    --build-portable) build build-portable -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF ;;
esac
