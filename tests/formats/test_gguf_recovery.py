"""Grid recovery end to end: a checkpoint whose layers already sit on Q4_0 or Q4_K grids (a
dequantized GGUF, a quantization-aware-trained release) becomes a GGUF of that type whose layer
tensors dequantize, by the gguf package, to the checkpoint's weights bit for bit."""

import json

import pytest
import torch
from conftest import on_gguf_grid, same_rows, save_tiny_llama
from safetensors.torch import load_file, save_file
from test_gguf import quantize, with_tokenizer

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def float_model(smollm2_bf16, tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("grid") / "fp32", dtype=torch.float32, vocab_size=49152,
                             hidden_size=256, intermediate_size=512, shard=None)
    return with_tokenizer(folder, smollm2_bf16)


def on_grids(float_model, out, kind: str):
    """The float model with every layer linear replaced by values decoded from random ``kind`` blocks."""
    out.mkdir()
    for f in float_model.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(float_model / "model.safetensors")
    for i, name in enumerate(sorted(n for n in tensors if ".layers." in n and n.endswith("_proj.weight"))):
        tensors[name] = on_gguf_grid(kind, *tensors[name].shape, seed=i)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, {n.removesuffix(".weight"): t for n, t in tensors.items() if ".layers." in n and "_proj" in n}


@pytest.mark.parametrize("kind,gguf_type", [("Q4_0", "q4_0"), ("Q4_K", "q4_k")])
def test_layers_on_a_gguf_grid_come_back_bit_for_bit(float_model, tmp_path, kind, gguf_type):
    from quantizer.formats.gguf.names import gguf_names

    source, weights = on_grids(float_model, tmp_path / "src", kind)
    out = quantize(source, tmp_path / "m.gguf", "--gguf-type", gguf_type)
    names = gguf_names(source, json.loads((source / "config.json").read_text()),
                       {m: tuple(w.shape) for m, w in weights.items()}).names
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    for module, (name,) in names.items():
        t = tensors[name]
        assert t.tensor_type.name == kind, name
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        assert same_rows(got, weights[module].numpy()), name
