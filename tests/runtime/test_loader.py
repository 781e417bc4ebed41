import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import quantize_to

from quantizer.cli.main import main
from quantizer.errors import InputError, UnsupportedError
from quantizer.io.tokenizer import load_tokenizer
from quantizer.runtime import load_model
from quantizer.runtime.activations import ENV, EXACT, Activations
from quantizer.runtime.decode.generation import encode_prompt, greedy_ids
from quantizer.runtime.kernels.w4a8 import has_w4a8
from quantizer.runtime.nn.int4 import Int4Linear, Int4Lookup
from quantizer.runtime.nn.swap import dequantize_modules


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("options", [{}, {"untie_head": True}, {"keep_embedding": True}, {"group_size": 32}])
def test_tiny_int4_model_matches_bf16_model_of_its_dequantized_weights(tiny_model, tmp_path, options):
    out = quantize_to(tiny_model, tmp_path / "q", **options)
    model = load_model(out)
    head = model.get_output_embeddings()
    kept = options.get("keep_embedding", False)
    assert isinstance(model.get_input_embeddings(), Int4Lookup) is not kept
    assert isinstance(head, Int4Linear) is not kept  # a head tied to a bf16 table stays bf16
    if not options:
        assert head.int4pack is model.get_input_embeddings().int4pack  # tied: one copy
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    got = torch.cat([logits(model, ids), logits(model, ids[:, :1])], dim=1)  # prefill path, then decode path
    reference = dequantize_modules(load_model(out))
    want = torch.cat([logits(reference, ids), logits(reference, ids[:, :1])], dim=1)
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_plain_bf16_checkpoint_loads_and_matches_transformers(tiny_model):
    from transformers import AutoModelForCausalLM

    ours = load_model(tiny_model)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(ours, ids), logits(theirs, ids))


def _with_qconfig(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes,error", [
    ({"quant_method": "awq"}, "cpu_int4 checkpoints, not quant_method 'awq'"),
    ({"group_size": 48}, "group_size 48 is not one of"),
    ({"bits": 3}, "bits is 3"),
    ({"format_version": 99}, "newer than this int4q"),
    ({"fancy_new_knob": 1}, "keys this int4q does not know: fancy_new_knob"),
    ({"group_size": 32}, "does not match group_size 32"),
    ({"dequant_threshold": 0}, "dequant_threshold must be"),
])
def test_checkpoint_asking_for_what_the_runtime_cannot_do_fails_clearly(tiny_q, tmp_path, changes, error):
    bad = _with_qconfig(tiny_q, tmp_path / "bad", **changes)
    with pytest.raises((InputError, UnsupportedError), match=error):
        load_model(bad)
    result = CliRunner().invoke(main, ["bench", str(bad), "--reps", "1"])
    assert result.exit_code == 1 and error.split(" ")[0] in result.stderr and "Traceback" not in result.stderr


def test_smollm2_int4_logits_match_its_dequantized_bf16_twin(smollm2_g64):
    tokenizer = load_tokenizer(smollm2_g64)
    ids = tokenizer("The quick brown fox jumps over the lazy dog because it", return_tensors="pt")["input_ids"]
    model = load_model(smollm2_g64, activations=EXACT)
    got = logits(model, ids)
    del model
    want = logits(dequantize_modules(load_model(smollm2_g64, activations=EXACT)), ids)
    assert (got - want).abs().max().item() < 0.03 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.skipif(not has_w4a8(), reason="this CPU has no AVX-512 VNNI: int8 activations fall back")
def test_smollm2_int8_prefill_adds_a_fraction_of_what_4_bit_rounding_costs(smollm2_g64, smollm2_bf16):
    tokenizer = load_tokenizer(smollm2_g64)
    ids = tokenizer("The quick brown fox jumps over the lazy dog because it", return_tensors="pt")["input_ids"]
    source, exact, int8 = (torch.log_softmax(logits(m, ids), -1) for m in (
        load_model(smollm2_bf16), load_model(smollm2_g64, activations=EXACT),
        load_model(smollm2_g64, activations=Activations("exact", "int8"))))

    def kld(p, q):
        return (p.exp() * (p - q)).sum(-1).mean().item()

    assert 0 < kld(exact, int8) < 0.2 * kld(source, exact)
    assert kld(source, int8) < 1.1 * kld(source, exact)


def test_smollm2_int4_greedy_answers_sensibly(smollm2_g64):
    tokenizer = load_tokenizer(smollm2_g64)
    model = load_model(smollm2_g64)
    ids = encode_prompt(tokenizer, "What is the capital of France?", chat=True)
    text = tokenizer.decode(greedy_ids(model, ids, 20)[0], skip_special_tokens=True)
    assert "Paris" in text


def test_generate_and_bench_commands_on_smollm2(smollm2_g64, smollm2_bf16, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # the activation options below set it for this process
    runner = CliRunner()
    result = runner.invoke(main, ["generate", str(smollm2_g64), "--prompt", "What is the capital of France?",
                                  "--chat", "--max-new-tokens", "12"])
    assert result.exit_code == 0 and "Paris" in result.stdout
    report = tmp_path / "bench.json"
    # Eager decode, as generate above (a short generation): the decoder and background tests cover
    # the compiled step, and compiling the bf16 baseline too would add two minutes to the suite.
    result = runner.invoke(main, ["bench", str(smollm2_g64), "--baseline", str(smollm2_bf16), "--prompt-tokens", "32",
                                  "--gen-tokens", "4", "--reps", "1", "--no-compile", "--json", str(report),
                                  "--compare-exact", "--decode", "int8", "--prefill", "int8"])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert set(data["arms"]) == {"int4", "exact", "baseline"} and data["activations"] == "decode=int8,prefill=int8"
    assert data["arms"]["int4"]["tg_median"] > 0 and data["arms"]["baseline"]["pp_median"] > 0
    assert 0 < data["ratios_int4_over_baseline"]["rss_anon_after_load"] < 1
    assert data["ratios_int4_over_exact"]["pp_median"] > 0


def test_every_end_of_sequence_id_of_the_folders_generation_config_stops_generation(tiny_q, byte_tokenizer, tmp_path):
    from quantizer.runtime.decode.generation import eos_token_ids

    folder = tmp_path / "q"
    shutil.copytree(tiny_q, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11], "bos_token_id": 1}))
    assert {7, 11} <= eos_token_ids(load_model(folder), byte_tokenizer)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"eos_token_id": [99]}))
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(outside)
    assert 99 not in eos_token_ids(load_model(folder), byte_tokenizer)  # never read through a link out of the folder


def test_the_head_multiplies_a_batch_of_rows_through_its_decode_kernels_not_a_dequantized_copy(tiny_q):
    from quantizer.runtime.loader import DECODE_ROWS

    head = load_model(tiny_q).get_output_embeddings()
    assert isinstance(head, Int4Linear) and head.threshold == DECODE_ROWS
    assert head.prefill_weight(DECODE_ROWS - 1) is None and head.prefill_weight(DECODE_ROWS) is not None
    wide = torch.randn(DECODE_ROWS - 1, 2 * head.in_features, generator=torch.Generator().manual_seed(0))
    rows = wide.to(torch.bfloat16)[:, ::2]  # not contiguous, as transformers slices the last positions
    with torch.inference_mode():
        assert torch.equal(head(rows), head(rows.contiguous()))
        expected = rows.float() @ head.dequantized_weight().float().t()
        assert torch.allclose(head(rows).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
