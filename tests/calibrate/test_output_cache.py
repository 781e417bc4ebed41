"""A layer's finished linears are answered from memory in the later passes over the windows,
with the very values they would have computed."""

import torch

import quantizer.calibrate.native_attention as native_attention
import quantizer.calibrate.output_cache as output_cache
import quantizer.quantization.layerwise as layerwise
from quantizer.calibrate.trace import Returned
from quantizer.calibrate.windows import CalibrationSettings
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.text import builtin_text
from quantizer.quantization.calibrated import run_calibrated
from quantizer.quantization.planning import QuantizeOptions, plan_quantization


def gptq_run(src, out, tokenizer):
    out.mkdir()
    plan = plan_quantization(src, QuantizeOptions(group_size=64, untie_head=True, method="gptq"))
    run_calibrated(plan, out, tokenizer, builtin_text("calib"), "calib", CalibrationSettings(4, 64, 0))
    reader = CheckpointReader(out)
    return {name: reader.get(name) for name in reader.infos}


def counting_products(monkeypatch) -> tuple[list, list]:
    """Calls of every linear, and of the tiny Llama's attention (int4q's causal kernel or SDPA)."""
    linears, attentions = [], []
    real, sdpa = torch.nn.Linear.forward, torch.nn.functional.scaled_dot_product_attention
    native = native_attention.causal_attention
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: linears.append(1) or real(self, x))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: attentions.append(1) or sdpa(*a, **k))
    monkeypatch.setattr(native_attention, "causal_attention", lambda *a: attentions.append(1) or native(*a))
    return linears, attentions


def test_cached_outputs_give_the_same_checkpoint_computing_each_product_once_a_window(tiny_model_tok, byte_tokenizer,
                                                                                     tmp_path, monkeypatch):
    linears, attentions = counting_products(monkeypatch)
    cached = gptq_run(tiny_model_tok, tmp_path / "cached", byte_tokenizer)
    with_cache = len(linears), len(attentions)
    monkeypatch.setattr(layerwise, "output_cache_budget", lambda hidden: 0)
    linears.clear()
    attentions.clear()
    uncached = gptq_run(tiny_model_tok, tmp_path / "uncached", byte_tokenizer)
    assert cached.keys() == uncached.keys()
    assert all(torch.equal(cached[name], uncached[name]) for name in cached)
    layers, windows, per_layer = 2, 4, 7  # the tiny Llama's layers and linears; the run's windows
    # the trace computes each linear and recomputes the two whose output a module returns; then
    # every linear and attention runs once a window
    assert with_cache == (layers * (per_layer + 2 + windows * per_layer), layers * (1 + windows))
    assert len(attentions) == layers * (1 + 4 * windows)  # without the cache: once a pass after the first


def test_a_module_whose_outputs_do_not_fit_is_computed_each_time():
    layer = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 8), "b": torch.nn.Linear(4, 64), "c": torch.nn.Linear(4, 4)})
    cache = output_cache.OutputCache(layer, {"a", "b", "c"}, windows=2, tokens=3, budget_bytes=4 * 2 * 3 * 8,
                                     settles={n: frozenset(n) for n in "abc"})
    cache.finish(["a", "b"])
    x, zeros = torch.randn(1, 3, 4), torch.zeros(1, 3, 4)
    first = layer["a"](x)
    assert torch.equal(layer["a"](zeros), first)  # window 0 answered from memory
    cache.window = 1
    computed = layer["a"](zeros)
    assert not torch.equal(computed, first) and torch.equal(layer["a"](x), computed)
    assert not torch.equal(layer["b"](zeros), layer["b"](x))  # 4 * 3 * 64 bytes a window: over the budget
    cache.close()
    assert not any("forward" in vars(m) for m in layer.values())


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.o(torch.softmax(self.q(x) * scale, -1)), None


def test_a_module_with_every_linear_finished_is_answered_and_its_linears_let_go():
    layer = torch.nn.ModuleDict({"attn": Attention(), "mlp": torch.nn.Linear(4, 4)})
    linears = ("attn.q", "attn.o", "mlp")
    settles = {"attn.q": frozenset(linears[:1]), "attn.o": frozenset(linears[:2]), "attn": frozenset(linears[:2]),
               "mlp": frozenset(linears)}
    cache = output_cache.OutputCache(layer, set(linears), windows=1, tokens=3, budget_bytes=10**6, settles=settles)
    x = torch.randn(1, 3, 4)
    cache.finish(["attn.q"])
    assert "forward" not in vars(layer["attn"])  # its o is still to be quantized
    cache.finish(["attn.o"])
    out, weights = layer["attn"](x, scale=2.0)
    again, _ = layer["attn"](torch.zeros(1, 3, 4))
    assert torch.equal(again, out) and weights is None and layer["attn"].calls == 1
    cache.finish(["mlp"])
    assert "forward" in vars(layer["attn"]) and "forward" not in vars(layer["attn"].q)
    used = cache.used_bytes
    last, _ = layer["attn"](torch.zeros(1, 3, 4))  # the replay reads it once: handed over, not copied
    assert torch.equal(last, out) and cache.used_bytes == used - out.numel() * 4


def test_a_module_returning_its_linears_output_is_answered_by_that_linear_on_its_kept_input():
    torch.manual_seed(0)
    layer = torch.nn.ModuleDict({"attn": Attention(), "mlp": torch.nn.Linear(4, 4)})
    x = torch.randn(1, 3, 4)
    settles = {"attn": frozenset({"attn.q", "attn.o"}), "attn.q": frozenset({"attn.q"})}
    cache = output_cache.OutputCache(layer, {"attn.q", "attn.o", "mlp"}, windows=2, tokens=3, budget_bytes=10**6,
                                     settles=settles, returns={"attn": Returned("attn.o", 2)})
    assert cache.answers_through(["attn.o"]) and not cache.answers_through(["mlp"])
    assert cache.keeper(["attn.q"]) is None
    cache.finish(["attn.q"])
    assert "forward" not in vars(layer["attn"].q)  # inside a module answered later through its o
    keep, o_input = cache.keeper(["attn.o"]), torch.randn(1, 3, 4)
    keep(0, o_input)
    assert cache.used_bytes == o_input.numel() * 4
    cache.finish(["attn.o"])
    out, weights = layer["attn"](torch.zeros(1, 3, 4))
    assert torch.equal(out, layer["attn"].o(o_input)) and weights is None and layer["attn"].calls == 0
    assert cache.used_bytes == out.numel() * 4  # the input let go of, the output kept
    assert torch.equal(layer["attn"](x)[0], out)
    cache.window = 1  # nothing kept for it: computed
    assert torch.equal(layer["attn"](x)[0], Attention.forward(layer["attn"], x)[0])
    cache.close()


def test_the_budget_is_a_multiple_of_the_inputs_and_at_most_half_the_free_memory(monkeypatch):
    hidden = torch.empty(2, 8, 16)
    monkeypatch.setattr(output_cache, "available_memory_bytes", lambda: 10**12)
    assert output_cache.output_cache_budget(hidden) == output_cache.CACHE_TO_INPUT * hidden.numel() * 4
    monkeypatch.setattr(output_cache, "available_memory_bytes", lambda: 1000)
    assert output_cache.output_cache_budget(hidden) == 500
