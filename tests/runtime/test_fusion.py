"""Fused q/k/v and gate/up projections compute exactly what the separate linears did."""

import pytest
import torch
from conftest import quantize_to

from quantizer.formats.cpu_int4 import FORMAT
from quantizer.methods.grid import quantize_groupwise
from quantizer.runtime import load_model
from quantizer.runtime.nn.fusion import (
    Int4Group,
    Int4Slice,
    fuse_linears,
    fuse_projections,
)
from quantizer.runtime.nn.int4 import Int4Linear
from quantizer.runtime.nn.swap import dequantize_modules
from quantizer.schema.scheme import ModuleScheme


def random_int4_linear(n, k, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    gq = quantize_groupwise(w, 64)
    packed, scale, zero = FORMAT.tensors("w", gq, ModuleScheme(4, 64)).values()
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    return Int4Linear.from_row_major(packed, scale, zero, 64, bias=b)


def fused_group(members):
    return Int4Group(fuse_linears(members), [m.out_features for m in members])


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("sizes", [(128, 64, 64), (64, 48, 16)])  # whole kernel blocks, and not
def test_fused_linear_is_bit_identical_to_its_members(rows, bias, sizes):
    members = [random_int4_linear(n, 128, seed, bias=bias and seed != 1) for seed, n in enumerate(sizes)]
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.inference_mode():
        for part, member in zip(fused_group(members)(x), members):
            assert torch.equal(part, member(x))


@pytest.mark.parametrize("rows", [1, 512])
def test_fused_prefill_keeps_each_members_rounding_where_one_big_gemm_would_not(rows):
    """Qwen2.5-1.5B's q/k/v shapes. On an AVX-512 + AMX machine (torch 2.13), one [2048, 1536]
    GEMM over 512 rows rounds some outputs differently from the unfused layers' three GEMMs."""
    members = [random_int4_linear(n, 1536, seed, bias=True) for seed, n in enumerate((1536, 256, 256))]
    x = torch.randn(1, rows, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        for part, member in zip(fused_group(members)(x), members):
            assert torch.equal(part, member(x))


def test_group_computes_once_per_input_and_then_lets_go():
    members = [random_int4_linear(64, 128, seed) for seed in range(3)]
    parent = torch.nn.Module()
    for name, m in zip(("q_proj", "k_proj", "v_proj"), members):
        parent.add_module(name, m)
    assert fuse_projections(parent) == 1
    group = parent.q_proj_k_proj_v_proj_fused
    calls = []
    real = group.linear.forward
    group.linear.forward = lambda x: calls.append(1) or real(x)
    x, y = torch.randn(1, 128).to(torch.bfloat16), torch.randn(1, 128).to(torch.bfloat16)
    with torch.inference_mode():
        outs = [parent.q_proj(x), parent.k_proj(x), parent.v_proj(x)]
        assert len(calls) == 1 and group._outs is None  # released after the last member
        parent.q_proj(y), parent.k_proj(x)  # a different input is recomputed
        assert len(calls) == 3
    for out, member in zip(outs, members):
        assert torch.equal(out, member(x))


def test_fused_model_gives_identical_logits(tiny_model, tmp_path):
    out = quantize_to(tiny_model, tmp_path / "q", group_size=64)
    fused, plain = load_model(out), load_model(out, fuse=False)
    assert sum(isinstance(m, Int4Group) for m in fused.modules()) == 4  # 2 layers x (qkv, gate/up)
    assert not any(isinstance(m, Int4Slice) for m in plain.modules())
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for length in (12, 1):
            assert torch.equal(fused(input_ids=ids[:, :length]).logits, plain(input_ids=ids[:, :length]).logits)


def test_dequantized_fused_model_matches_dequantized_plain_one(tiny_model, tmp_path):
    out = quantize_to(tiny_model, tmp_path / "q", group_size=64)
    a, b = dequantize_modules(load_model(out)), dequantize_modules(load_model(out, fuse=False))
    assert not any(isinstance(m, (Int4Group, Int4Slice, Int4Linear)) for m in a.modules())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
