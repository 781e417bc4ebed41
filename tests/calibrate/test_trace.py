"""One window's forward tells the driver a layer's steps and when each module's output is final."""

import json

import torch

import quantizer.calibrate.capture as capture
from quantizer.calibrate.trace import Returned, trace_layer
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.structure import build_empty_model
from quantizer.quantization.layerwise import _materialize as materialize

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


def test_an_attention_and_an_mlp_return_their_last_linears_output(tiny_model_tok):
    layer, hidden, kwargs = llama_layer(tiny_model_tok)
    trace = trace_layer(layer, hidden[:1], kwargs, ATTENTION | MLP)
    assert trace.returns == {"self_attn": Returned("self_attn.o_proj", 2), "mlp": Returned("mlp.down_proj", None)}
    out = torch.ones(2)
    assert Returned("o", 3).wrap(out) == (out, None, None) and Returned("o", None).wrap(out) is out


class Projected(torch.nn.Module):
    """A linear's output returned as it is, with None, changed in place, added to, or beside a tensor."""

    def __init__(self, how: str):
        super().__init__()
        self.proj, self.how = torch.nn.Linear(4, 4), how

    def forward(self, x):
        y = self.proj(x)
        if self.how == "in place":
            y.mul_(2)
        return {"as is": y, "in place": y, "added to": y + 1, "beside": (y, x)}.get(self.how, (y, None))


def test_only_a_module_whose_output_is_its_linears_unchanged_returns_it():
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    found = {how: trace_layer(torch.nn.Sequential(Projected(how)), x, {}, {"0.proj"}).returns
             for how in ("as is", "with None", "in place", "added to", "beside")}
    assert found["as is"] == {"0": Returned("0.proj", None)}
    assert found["with None"] == {"0": Returned("0.proj", 2)}
    assert found["in place"] == found["added to"] == found["beside"] == {}
