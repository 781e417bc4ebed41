"""One window's forward tells the driver a layer's steps and when each module's output is final."""

import json

import torch

import quantizer.calibrate.capture as capture
from quantizer.calibrate.trace import trace_layer
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.structure import build_empty_model
from quantizer.quantize.layerwise import _materialize as materialize

ATTENTION = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
MLP = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def llama_layer(path):
    """Layer 0 of the tiny Llama in fp32, its inputs for one window and its keyword arguments."""
    config = json.loads((path / "config.json").read_text())
    model = build_empty_model(config).float()
    materialize(model.model.layers[0], "model.layers.0", CheckpointReader(path))
    materialize(model.get_input_embeddings(), "model.embed_tokens", CheckpointReader(path))
    windows = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    hidden, kwargs = capture.capture_inputs(model, model.model.layers, windows, all_samples=True)
    return model.model.layers[0], hidden, kwargs


def test_a_norm_is_final_from_the_start_or_once_the_linears_before_it_are(tiny_model_tok):
    layer, hidden, kwargs = llama_layer(tiny_model_tok)
    trace = trace_layer(layer, hidden[:1], kwargs, ATTENTION | MLP)
    assert trace.settles["input_layernorm"] == frozenset()
    assert trace.settles["post_attention_layernorm"] == ATTENTION
    assert trace.settles["self_attn"] == ATTENTION
    assert trace.settles["mlp.gate_proj"] == ATTENTION | {"mlp.gate_proj"}
    assert "mlp.act_fn" not in trace.settles  # its output is larger than the layer's input
    with torch.inference_mode():
        assert torch.equal(trace.output, capture.hidden_of(layer(hidden[:1], **kwargs)))
    assert trace.inputs["mlp.down_proj"].shape[-1] == layer.mlp.down_proj.in_features

def test_a_module_called_twice_a_forward_is_never_kept():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.norm(self.proj(self.norm(x)))

    trace = trace_layer(Twice(), torch.randn(1, 3, 4), {}, {"proj"})
    assert "norm" not in trace.settles and trace.settles["proj"] == frozenset({"proj"})
    assert trace.steps == [["proj"]]
