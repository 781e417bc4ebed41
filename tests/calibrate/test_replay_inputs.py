"""The replay reads the last step's kept inputs where, and only where, that gives the layer's own
outputs, and then computes the step before's linears no more."""

import torch
from test_trace import ATTENTION, MLP, llama_layer

from quantizer.calibrate.replay_inputs import replay_inputs
from quantizer.calibrate.trace import trace_layer


class Mlp(torch.nn.Module):
    """gate/up then down; with ``leak``, up's output also reaches the output past down."""

    def __init__(self, leak: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate, self.up, self.down = (torch.nn.Linear(4, 8), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)
        self.leak = leak

    def forward(self, x):
        u = self.up(x)
        y = x + self.down(torch.relu(self.gate(x)) * u)
        return y + u[..., :4] if self.leak else y


def unbounded(size: int) -> bool:
    return True


def test_a_layer_whose_step_before_reaches_its_output_otherwise_is_replayed_in_full():
    x = torch.randn(1, 3, 4)
    for leak in (False, True):
        layer = Mlp(leak)
        trace = trace_layer(layer, x, {}, {"gate", "up", "down"})
        replay = replay_inputs(layer, trace, x, {}, 2, unbounded)
        assert (replay is None) == leak


def test_the_replay_from_kept_inputs_gives_the_layers_outputs_without_the_step_before(tiny_model_tok, monkeypatch):
    layer, hidden, kwargs = llama_layer(tiny_model_tok)
    trace = trace_layer(layer, hidden[:1], kwargs, ATTENTION | MLP)
    replay = replay_inputs(layer, trace, hidden[:1], kwargs, 1, unbounded)
    assert replay is not None and replay.before == ["mlp.gate_proj", "mlp.up_proj"]
    replay.keep(0, trace.inputs["mlp.down_proj"])
    computed = []
    real = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: computed.append(self) or real(self, x))
    with torch.inference_mode(), replay.substituting(0):
        out = layer(hidden[:1], **kwargs)
    assert torch.equal(out[0] if isinstance(out, tuple) else out, trace.output)
    assert layer.mlp.gate_proj not in computed and layer.mlp.up_proj not in computed
    assert layer.mlp.down_proj in computed
    assert "forward" not in vars(layer.mlp.gate_proj)  # given back


def test_an_input_over_the_budget_is_not_kept(tiny_model_tok, monkeypatch):
    layer, hidden, kwargs = llama_layer(tiny_model_tok)
    trace = trace_layer(layer, hidden[:1], kwargs, ATTENTION | MLP)
    replay = replay_inputs(layer, trace, hidden[:1], kwargs, 1, lambda size: False)
    replay.keep(0, trace.inputs["mlp.down_proj"])
    computed = []
    real = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: computed.append(self) or real(self, x))
    with torch.inference_mode(), replay.substituting(0):
        layer(hidden[:1], **kwargs)
    assert layer.mlp.up_proj in computed
