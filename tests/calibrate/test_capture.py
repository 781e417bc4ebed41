"""Capturing what a decoder layer sees: its inputs, and its linears grouped by shared input."""

import json

import torch

import quantizer.calibrate.capture as capture
from quantizer.calibrate.trace import trace_layer
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.structure import build_empty_model
from quantizer.quantization.layerwise import _materialize as materialize

STEPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
         ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def test_steps_group_linears_by_shared_input_in_call_order(tiny_model_tok):
    config = json.loads((tiny_model_tok / "config.json").read_text())
    model = build_empty_model(config).float()
    layer = model.model.layers[0]
    materialize(layer, "model.layers.0", CheckpointReader(tiny_model_tok))
    windows = torch.randint(0, 256, (1, 16))
    materialize(model.get_input_embeddings(), "model.embed_tokens", CheckpointReader(tiny_model_tok))
    hidden, kwargs = capture.capture_inputs(model, model.model.layers, windows, all_samples=True)
    wanted = {n for step in STEPS for n in step}
    for _ in range(5):  # the allocator must not be able to make two inputs look alike
        assert trace_layer(layer, hidden[:1], kwargs, wanted).steps == STEPS


def test_feed_gives_the_statistic_each_window_and_stops_there():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    seen, after = [], []
    layer[1].register_forward_hook(lambda *a: after.append(1))

    class Acc:
        def add(self, x):
            seen.append(x.clone())

    xs = torch.randn(3, 1, 4)
    capture.feed(layer[1], Acc(), lambda s: layer(xs[s]), 3)
    assert len(seen) == 3 and after == []
    assert torch.allclose(seen[2], layer[0](xs[2]))
