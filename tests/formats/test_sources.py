"""Checkpoints other tools quantized, in: each layout reads as the float model it stands for (as
llama.cpp's converter dequantizes it, where it can), its grids carry into GGUF and cpu_int4 bit for
bit where the output holds them and to the nearest stored values or by the method where not, the
run says which, and anything int4q does not read is one line with nothing written."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import CACHE, assert_llama_cpp_generates, same_rows, save_tiny_llama
from quantized_sources import CONFIGS, grid, write_quantized
from test_gguf import needs_llama_cpp, run, with_tokenizer

from quantizer.formats.sources import open_quantized

gguf = pytest.importorskip("gguf")

ASYM_CT = {**CONFIGS["compressed-tensors"], "config_groups": {"group_0": {
    **CONFIGS["compressed-tensors"]["config_groups"]["group_0"],
    "weights": {**CONFIGS["compressed-tensors"]["config_groups"]["group_0"]["weights"], "symmetric": False,
                "group_size": 64}}}}
LAYOUTS = {  # name -> (layout, config, act-order)
    "gptq": ("gptq", CONFIGS["gptq"], False),
    "gptq-asym-g32": ("gptq", {**CONFIGS["gptq"], "sym": False, "group_size": 32}, False),
    "gptq-per-channel": ("gptq", {**CONFIGS["gptq"], "group_size": -1}, False),
    "gptq_v2-act-order": ("gptq", {**CONFIGS["gptq_v2"], "group_size": 32}, True),
    "compressed-tensors": ("compressed-tensors", CONFIGS["compressed-tensors"], False),
    "compressed-tensors-asym": ("compressed-tensors", ASYM_CT, False),
    "awq": ("awq", CONFIGS["awq"], False),
}
PRODUCED = CACHE / "quantized-sources"  # benchmarks/make_quantized_sources.py writes them here


@pytest.fixture(scope="module")
def float_model(smollm2_bf16, tmp_path_factory):
    """A tiny Llama (hidden 128, so groups of 128 fit) with SmolLM2's tokenizer, in one file."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("bridge") / "bf16", vocab_size=49152, hidden_size=128,
                             intermediate_size=256, shard=None)
    return with_tokenizer(folder, smollm2_bf16)


@pytest.fixture(scope="module")
def sources(float_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {name: write_quantized(float_model, root / name, layout, config, act_order)
            for name, (layout, config, act_order) in LAYOUTS.items()}


def view(folder: Path):
    return open_quantized(folder, json.loads((folder / "config.json").read_text()))


def converters_dequantization(folder: Path) -> dict:
    """llama.cpp's converter's own dequantization of a GPTQ or compressed-tensors checkpoint."""
    from quantizer.formats.gguf.converter import converter_class, load

    _, gguf_py = load()
    cls = converter_class(json.loads((folder / "config.json").read_text()))
    model = cls(folder, gguf_py.LlamaFileType.GUESSED, folder / "unused.gguf", eager=True)
    model.dequant_model()
    return model.model_tensors


@pytest.mark.parametrize("name", [n for n in LAYOUTS if LAYOUTS[n][0] != "awq"])
def test_each_layout_reads_as_llama_cpps_converter_dequantizes_it(sources, name):
    mine, theirs = view(sources[name]), converters_dequantization(sources[name])
    weights = [n for n in mine.infos if mine.grid(n) is not None]
    assert len(weights) == 14  # 7 linears in each of 2 layers
    for n in weights:
        assert torch.equal(mine.get(n), theirs[n]().float()), n


def test_awq_reads_as_its_codes_zero_points_and_scales(float_model, sources):
    from safetensors.torch import load_file

    w = load_file(float_model / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    codes, scale, points, g_idx = grid(w, 128, False, torch.float16)
    expected = ((codes - points[:, g_idx]).float() * scale.float()[:, g_idx])
    assert torch.equal(view(sources["awq"]).get("model.layers.1.mlp.down_proj.weight"), expected)


def quantize(source, out, *extra):
    result = run("quantize", "--model", source, "--out", out, "--no-progress", *extra)
    assert result.exit_code == 0, result.output
    return result.output


def gguf_rows_equal_source(path: Path, source: Path) -> dict[str, bool]:
    """Per quantized module: whether its GGUF tensor dequantizes (by the gguf package) to the
    source's values, row for row (the converter may reorder rows: q/k heads)."""
    from quantizer.formats.gguf.names import gguf_names

    src = view(source)
    modules = {n.removesuffix(".weight"): src.infos[n].shape for n in src.infos if src.grid(n) is not None}
    names = gguf_names(source, json.loads((source / "config.json").read_text()), modules).names
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    same = {}
    for module, (name,) in names.items():
        t = tensors[name]
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        same[module] = same_rows(got, src.get(f"{module}.weight").numpy())
    return same


@pytest.mark.parametrize("name", ["gptq", "gptq-per-channel", "compressed-tensors"])
def test_symmetric_grids_become_q4_0_blocks_that_dequantize_to_the_source_bit_for_bit(sources, name, tmp_path):
    out = tmp_path / "m.gguf"
    said = quantize(sources[name], out, "--format", "gguf")
    assert "of its 14 quantized modules 14 carried over exactly" in said
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {types[n] for n in types if n.startswith("blk.") and not n.endswith("norm.weight")} == {"Q4_0"}
    assert all(gguf_rows_equal_source(out, sources[name]).values())


@pytest.mark.parametrize("name", ["gptq-asym-g32", "compressed-tensors-asym", "awq"])
def test_asymmetric_grids_keep_their_codes_in_q4_1_with_the_nearest_fp16_minimum(sources, name, tmp_path):
    out = tmp_path / "m.gguf"
    said = quantize(sources[name], out, "--format", "gguf")
    report = said.splitlines()[-1]
    assert "rounded again" in report and " 0 rounded again" in report, report
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_1"
    src = view(sources[name])
    down = gguf.GGUFReader(out).tensors
    t = next(t for t in down if t.name == "blk.0.ffn_down.weight")
    got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    want = src.get("model.layers.0.mlp.down_proj.weight")
    scale = src.grid("model.layers.0.mlp.down_proj.weight").scale.max().item()
    # only each block's minimum moved, by at most half an fp16 step of its size (15 steps at most)
    assert (got - want).abs().max().item() <= 15 * scale * 2**-11


def test_act_order_groups_that_are_not_runs_of_32_are_rounded_again_by_the_method(sources, tmp_path):
    said = quantize(sources["gptq_v2-act-order"], tmp_path / "m.gguf", "--format", "gguf")
    assert "0 carried over exactly, 0 to the nearest stored scale and zero, 14 rounded again" in said


def test_a_bf16_scaled_source_becomes_cpu_int4_exactly_and_verifies_against_the_float_model(
        float_model, sources, tmp_path):
    out = tmp_path / "cpu"
    said = quantize(sources["compressed-tensors"], out)
    assert "the output takes a symmetric grid and group size 128 from it" in said
    assert "14 carried over exactly" in said
    report = json.loads((out / "quantization_report.json").read_text())
    assert report["quantization_config"]["group_size"] == 128 and report["quantization_config"]["symmetric"]
    from safetensors.torch import load_file

    stored = load_file(out / "model.safetensors")
    grid_ = view(sources["compressed-tensors"]).grid("model.layers.0.self_attn.o_proj.weight")
    assert torch.equal(stored["model.layers.0.self_attn.o_proj.weight_scale"].double(), grid_.scale)
    result = run("verify", out, "--reference", float_model, "--ctx", "64", "--max-windows", "2", "--greedy-tokens", "4")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name,kind", [("gptq", "nearest"), ("gptq-asym-g32", "nearest"), ("awq", "nearest"),
                                       ("compressed-tensors-asym", "nearest"), ("gptq_v2-act-order", "rounded")])
def test_every_layout_becomes_cpu_int4_and_says_what_became_of_each_grid(sources, name, kind, tmp_path):
    said = quantize(sources[name], tmp_path / "cpu")
    report = json.loads((tmp_path / "cpu" / "quantization_report.json").read_text())
    kinds = {e["source_grid"] for m, e in report["tensors"].items() if m != "model.embed_tokens"}
    assert kinds == {kind}, said  # fp16 scales, or zeros that are not bf16 values, round to the nearest bf16


def test_a_symmetric_gptq_checkpoint_is_its_own_gptq_export(sources, tmp_path):
    from safetensors.torch import load_file

    quantize(sources["gptq"], tmp_path / "gptq", "--format", "gptq")
    mine, theirs = load_file(tmp_path / "gptq" / "model.safetensors"), load_file(sources["gptq"] / "model.safetensors")
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        name = f"model.layers.1.mlp.down_proj.{suffix}"
        assert torch.equal(mine[name], theirs[name]), name


def test_a_cpu_int4_checkpoint_becomes_a_gguf_without_the_float_model(float_model, tmp_path):
    cpu = tmp_path / "cpu"
    quantize(float_model, cpu, "--sym", "--group-size", "32")
    said = quantize(cpu, tmp_path / "m.gguf", "--format", "gguf")
    assert "of its 15 quantized modules 15 carried over exactly" in said  # bf16 scales are fp16 values here
    same = gguf_rows_equal_source(tmp_path / "m.gguf", cpu)
    assert len(same) == 15 and all(same.values())


@needs_llama_cpp
def test_llama_cpp_runs_a_gguf_converted_from_gptq(sources, tmp_path):
    out = tmp_path / "m.gguf"
    quantize(sources["gptq"], out, "--format", "gguf")
    assert_llama_cpp_generates(out)


REFUSED = {
    "3-bit GPTQ": ({**CONFIGS["gptq"], "bits": 3}, "3-bit GPTQ"),
    "Marlin-repacked GPTQ": ({**CONFIGS["gptq"], "checkpoint_format": "marlin"}, "'marlin' packing"),
    "GEMV AWQ": ({**CONFIGS["awq"], "version": "gemv"}, "'gemv' packing"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized by 'bitsandbytes'"),
    "fp8 compressed-tensors": ({**CONFIGS["compressed-tensors"], "format": "float-quantized"},
                               "'float-quantized' format"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_quantization_int4q_does_not_read_is_one_line_and_nothing_is_written(sources, case, tmp_path):
    config, found = REFUSED[case]
    folder = tmp_path / "src"
    folder.mkdir()
    for f in sources["gptq"].iterdir():
        if f.name != "config.json":
            os.symlink(f, folder / f.name)
    cfg = json.loads((sources["gptq"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    for fmt in ("gguf", "cpu_int4"):
        out = tmp_path / ("m.gguf" if fmt == "gguf" else "out")
        result = run("quantize", "--model", folder, "--out", out, "--format", fmt, "--no-progress")
        assert result.exit_code != 0 and not out.exists()
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and found in lines[0] and "GPTQ (v1 and v2 packing, 4-bit)" in lines[0], result.output


@pytest.mark.parametrize("name,exact", [("gptqmodel-sym-g64", True), ("gptqmodel-sym-g32", True),
                                        ("llmcompressor-w4a16", True), ("gptqmodel-asym-g64", False),
                                        ("llmcompressor-w4a16-asym", False), ("gptqmodel-sym-g64-actorder", False)])
def test_checkpoints_the_producers_made_convert_to_gguf(name, exact, tmp_path):
    source = PRODUCED / name
    if not (source / "config.json").is_file():
        pytest.skip(f"{name} is not made here: benchmarks/make_quantized_sources.py (GPTQModel, llm-compressor)")
    out = tmp_path / "m.gguf"
    said = quantize(source, out, "--format", "gguf")
    same = gguf_rows_equal_source(out, source)
    assert all(same.values()) if exact else not any(same.values()), said
