"""Never worse than llama-quantize: on a model of genuinely full-precision (seeded random) weights,
every layer tensor of int4q's round-to-nearest GGUF is at least as close to the weights as
llama-quantize's (without an importance matrix, ``--pure``), type by type, tensor by tensor."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import save_tiny_llama
from test_gguf import quantize, with_tokenizer

gguf = pytest.importorskip("gguf")
LLAMA_QUANTIZE = f"{sys.prefix}/share/int4q/llama.cpp/build/bin/llama-quantize"
needs_llama_quantize = pytest.mark.skipif(not shutil.which(LLAMA_QUANTIZE), reason="llama.cpp's tools are not built "
                                          "here: bash scripts/setup_gguf.sh --build")
TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]


@pytest.fixture(scope="module")
def model(smollm2_bf16, tmp_path_factory):
    """A random fp32 Llama (rows of whole super-blocks) and llama.cpp's f32 GGUF of it."""
    from quantizer.formats.gguf.converter import converter_root

    folder = save_tiny_llama(tmp_path_factory.mktemp("vs-llama") / "fp32", dtype=torch.float32, vocab_size=49152,
                             hidden_size=256, intermediate_size=768, shard=None)
    with_tokenizer(folder, smollm2_bf16)
    f32 = folder.parent / "f32.gguf"
    subprocess.run([sys.executable, converter_root() / "convert_hf_to_gguf.py", folder, "--outtype", "f32",
                    "--outfile", f32], check=True, capture_output=True)
    return folder, {t.name: np.array(t.data) for t in gguf.GGUFReader(f32).tensors}


def errors(path, reference: dict) -> dict[str, tuple[str, float]]:
    """Per layer tensor: its type and squared error against the f32 weights."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and "norm" not in t.name:
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            out[t.name] = (t.tensor_type.name, float(((got - reference[t.name]) ** 2).sum()))
    return out


@needs_llama_quantize
@pytest.mark.parametrize("gguf_type", TYPES)
def test_every_layer_tensor_is_at_least_as_close_as_llama_quantizes(model, tmp_path, gguf_type):
    folder, reference = model
    theirs = tmp_path / "llama.gguf"
    subprocess.run([LLAMA_QUANTIZE, "--pure", folder.parent / "f32.gguf", theirs, gguf_type.upper(), "2"], check=True,
                   capture_output=True)
    mine = errors(quantize(folder, tmp_path / "int4q.gguf", "--gguf-type", gguf_type), reference)
    ref = errors(theirs, reference)
    assert mine.keys() == ref.keys() and len(mine) == 14
    for name, (kind, err) in mine.items():
        assert kind == ref[name][0] == gguf_type.upper(), name
        assert err <= ref[name][1] * (1 + 1e-6), (name, err / ref[name][1])
    assert sum(e for _, e in mine.values()) <= sum(e for _, e in ref.values())
