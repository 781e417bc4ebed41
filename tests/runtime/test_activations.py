"""The activation-precision setting (quantizer.runtime.activations) and what the loader makes of it."""

import pytest
import torch
from conftest import quantize_to

from quantizer.errors import UsageError
from quantizer.runtime import load_model
from quantizer.runtime.activations import ENV, Activations, choose, current
from quantizer.runtime.decode.compiled import artifact_path
from quantizer.runtime.kernels.w4a8 import has_w4a8
from quantizer.runtime.nn.int4 import Int4Linear


@pytest.fixture
def setting(monkeypatch):
    """INT4Q_ACTIVATIONS as this test leaves it is undone afterwards."""
    monkeypatch.delenv(ENV, raising=False)
    yield
    monkeypatch.delenv(ENV, raising=False)


def test_the_setting_round_trips_through_its_text(setting):
    for a in (Activations("int8", "exact"), Activations("exact", "int8"), Activations("exact", "exact")):
        assert Activations.parse(a.encode()) == a
    assert Activations.parse("prefill=int8") == Activations(prefill="int8")


def test_choose_sets_the_process_setting_and_keeps_the_phase_not_named(setting):
    assert current() == Activations()
    choose(prefill="int8")
    assert current() == Activations(Activations().decode, "int8")
    choose(decode="exact")
    assert current() == Activations("exact", "int8")


@pytest.mark.parametrize("text, message", [("decode=int9", "decode activations must be one of exact, int8"),
                                           ("speed=fast", "unknown phase 'speed'")])
def test_a_bad_setting_is_one_line_naming_the_fix(setting, monkeypatch, text, message):
    monkeypatch.setenv(ENV, text)
    with pytest.raises(UsageError, match=message) as e:
        current()
    assert "unset it" in str(e.value) and "\n" not in str(e.value)


def layer_linears(model):
    """The int4 linears of the decoder layers (not the head)."""
    return [m for m in model.modules() if isinstance(m, Int4Linear) and m is not model.get_output_embeddings()]


@pytest.mark.parametrize("untie_head", [False, True])
def test_the_loader_gives_every_layer_linear_the_chosen_activations_and_the_head_exact(tiny_model, tmp_path, setting,
                                                                                       untie_head):
    folder = quantize_to(tiny_model, tmp_path / "q", group_size=64, untie_head=untie_head)
    model = load_model(folder, activations=Activations("exact", "int8"))
    assert layer_linears(model) and all(not m.int8_decode and m.int8_prefill for m in layer_linears(model))
    head = model.get_output_embeddings()
    assert isinstance(head, Int4Linear) and not head.int8_decode and not head.int8_prefill
    choose("int8", "exact")
    assert all(m.int8_decode and not m.int8_prefill for m in layer_linears(load_model(folder)))


def test_a_compiled_step_is_kept_apart_per_activation_choice(tiny_q, setting):
    exact = load_model(tiny_q, activations=Activations("exact", "exact"))
    int8 = load_model(tiny_q, activations=Activations("int8", "exact"))
    assert artifact_path(exact) != artifact_path(int8)


@pytest.mark.skipif(not has_w4a8(), reason="this CPU has no AVX-512 VNNI: int8 activations fall back")
def test_int8_logits_stay_close_to_the_exact_ones_in_prefill_and_decode(tiny_q, setting):
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, a in (("exact", Activations("exact", "exact")), ("int8", Activations("int8", "int8"))):
        model = load_model(tiny_q, activations=a)
        with torch.inference_mode():
            outs[name] = torch.cat([model(input_ids=ids).logits, model(input_ids=ids[:, :1]).logits], 1).float()
    assert not torch.equal(outs["exact"], outs["int8"])  # the int8 path ran
    error = (outs["int8"] - outs["exact"]).norm() / outs["exact"].norm()
    assert error.item() < 0.02
