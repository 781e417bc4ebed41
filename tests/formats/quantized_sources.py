"""Small quantized checkpoints in the layouts other tools write (GPTQ v1 and v2, AWQ GEMM,
compressed-tensors pack-quantized), packed here bit by bit from each layout's description, not by
int4q's own packers, under ``quantization_config`` blocks reproduced from real Hub releases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word bit 4j holds channel 8i + AWQ_ORDER[j]

CONFIGS = {
    # Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4
    "gptq": {"bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128,
             "modules_in_block_to_quantize": None, "quant_method": "gptq", "sym": True, "true_sequential": True},
    # GPTQModel's own v2 packing (zero points stored as they are), act-order
    "gptq_v2": {"bits": 4, "group_size": 128, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2",
                "quant_method": "gptq", "lm_head": False},
    # Qwen/Qwen2.5-7B-Instruct-AWQ
    "awq": {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
            "zero_point": True},
    # RedHatAI's W4A16 releases, as llm-compressor writes them
    "compressed-tensors": {
        "config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None, "output_activations": None,
                                      "targets": ["Linear"],
                                      "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                  "group_size": 128, "num_bits": 4, "observer": "minmax",
                                                  "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                                  "type": "int"}}},
        "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"},
}


def grid(w: torch.Tensor, group: int, symmetric: bool, scale_dtype, order: torch.Tensor | None = None):
    """Round-to-nearest of w [N, K] in groups of ``group`` columns (of ``order``'s permutation,
    act-order style): (codes [N, K] int64, scale [N, G] as stored, zero points [N, G] int64, g_idx [K])."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    g = w[:, order].reshape(n, k // group, group).float()
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).to(scale_dtype)
        points = torch.full(scale.shape, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).to(scale_dtype)
        points = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.int64)
    s, z = scale.float()[:, g_idx], points[:, g_idx]
    codes = torch.round(w.float() / s + z).clamp(0, 15).to(torch.int64)
    return codes, scale, points, g_idx


def pack_along_last(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, 8m] nibbles -> [R, m] int32: bit 4j of word i holds element 8i + order[j]."""
    r, n = values.shape
    v = values.reshape(r, n // 8, 8).to(torch.int64)
    word = torch.zeros(r, n // 8, dtype=torch.int64)
    for j, src in enumerate(order):
        word |= v[..., src] << (4 * j)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def module_tensors(layout: str, module: str, w: torch.Tensor, config: dict, order=None) -> dict:
    """One linear's tensors in ``layout`` for its float weight w [N, K]."""
    n, k = w.shape
    if layout == "compressed-tensors":
        weights = config["config_groups"]["group_0"]["weights"]
        codes, scale, points, _ = grid(w, weights["group_size"], weights["symmetric"], torch.bfloat16)
        out = {f"{module}.weight_packed": pack_along_last(codes), f"{module}.weight_scale": scale,
               f"{module}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not weights["symmetric"]:
            out[f"{module}.weight_zero_point"] = pack_along_last(points.t().contiguous()).t().contiguous()
        return out
    group = config["group_size"] if config["group_size"] > 0 else k
    symmetric = config.get("sym", layout != "awq")
    codes, scale, points, g_idx = grid(w, group, symmetric, torch.float16, order)
    if layout == "awq":
        return {f"{module}.qweight": pack_along_last(codes.t().contiguous(), AWQ_ORDER),
                f"{module}.qzeros": pack_along_last(points.t().contiguous(), AWQ_ORDER),
                f"{module}.scales": scale.t().contiguous()}
    stored = points - (1 if config.get("checkpoint_format", "gptq") == "gptq" else 0)
    return {f"{module}.qweight": _gptq_qweight(codes),
            f"{module}.qzeros": pack_along_last(stored.t().contiguous()),
            f"{module}.scales": scale.t().contiguous(), f"{module}.g_idx": g_idx.to(torch.int32)}


def _gptq_qweight(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [K/8, N]: bit 4j of word [i, n] holds the code of column 8i + j of row n."""
    return pack_along_last(codes).t().contiguous()


def write_quantized(float_dir: Path, out: Path, layout: str, config: dict | None = None, act_order=False) -> Path:
    """A copy of the float checkpoint ``float_dir`` (one safetensors file) with every decoder-layer
    linear stored in ``layout`` under ``config`` (default: the layout's reproduced release)."""
    config = dict(config or CONFIGS[layout])
    out.mkdir(parents=True)
    for f in float_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    tensors = load_file(float_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    written = {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            order = torch.randperm(t.shape[1], generator=gen) if act_order else None
            written.update(module_tensors(layout, module, t, config, order))
        else:
            written[name] = t
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(cfg))
    return out
