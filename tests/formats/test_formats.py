"""The format interface: every registered format's planned specs are exactly the tensors it
writes, and its structural check names what is wrong."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer.errors import UnsupportedError
from quantizer.formats import NAMES, format_of_config, get_format
from quantizer.io.checkpoint import TensorInfo
from quantizer.methods.grid import quantize_groupwise, quantize_per_channel
from quantizer.schema.scheme import ModuleScheme


def infos_of(tensors):
    return {n: TensorInfo(n, None, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()) for n, t in tensors.items()}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(NAMES), n8=st.integers(1, 6), groups=st.integers(1, 3), group=st.sampled_from([32, 64]),
       symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_specs_are_the_written_tensors_and_pass_the_check(name, n8, groups, group, symmetric, seed):
    fmt = get_format(name)
    group = group if group in fmt.group_sizes else fmt.group_sizes[0]
    n, k = 8 * n8, groups * group
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    scheme = ModuleScheme(4, group, symmetric)
    gq = quantize_groupwise(w, group, symmetric=symmetric, storage=fmt.grid_storage(scheme, k))
    tensors = fmt.tensors("m", gq, scheme)
    assert [(s.name, s.dtype, s.shape) for s in fmt.tensor_specs("m", (n, k), scheme)] == \
           [(n_, t.dtype, tuple(t.shape)) for n_, t in tensors.items()]
    assert fmt.module_problems("m", infos_of(tensors), scheme) == []
    assert f"m.{fmt.marker}" in tensors


@pytest.mark.parametrize("name", NAMES)
def test_the_check_names_a_missing_or_misshaped_tensor(name):
    fmt = get_format(name)
    scheme = ModuleScheme(4, 32, False)
    tensors = fmt.tensors("m", quantize_groupwise(torch.randn(16, 64), 32, storage=fmt.grid_storage(scheme, 64)), scheme)
    first, last = list(tensors)[0], list(tensors)[-1]
    assert fmt.module_problems("m", infos_of({k: v for k, v in tensors.items() if k != last}), scheme) == \
           [f"{last}: missing"]
    wrong = dict(tensors)
    wrong[last] = wrong[last].to(torch.float64)
    assert fmt.module_problems("m", infos_of(wrong), scheme)[0].startswith(last)
    assert fmt.module_problems("m", infos_of(tensors), ModuleScheme(4, 32, True)) != [] or \
        fmt.module_problems("m", infos_of(tensors), ModuleScheme(4, 64, False)) != []
    assert first.endswith(fmt.marker)


def test_formats_are_found_by_name_and_by_config():
    assert format_of_config({"quant_method": "cpu_int4"}) is get_format("cpu_int4")
    assert format_of_config({"quant_method": "gptq", "bits": 4}) is get_format("gptq")
    assert format_of_config({"quant_method": "awq"}) is get_format("awq")
    assert format_of_config({"quant_method": "exl2"}) is None and format_of_config("junk") is None
    with pytest.raises(UnsupportedError, match="format 'exl2' is not one of cpu_int4, gptq, awq, gguf"):
        get_format("exl2")


def test_an_8_bit_module_is_written_by_cpu_int4_and_refused_by_the_gptq_export():
    cpu, gptq = get_format("cpu_int4"), get_format("gptq")
    q = quantize_per_channel(torch.randn(16, 40))
    tensors = cpu.tensors("m", q, ModuleScheme(8))
    assert [(t.dtype, tuple(t.shape)) for t in tensors.values()] == [(torch.int8, (16, 40)), (torch.bfloat16, (16, 1))]
    assert cpu.module_problems("m", infos_of(tensors), ModuleScheme(8)) == []
    assert cpu.module_problems("m", infos_of(tensors), ModuleScheme(4, 32)) == ["m.weight_zero: missing"]
    assert gptq.module_problems("m", {}, ModuleScheme(8)) == ["m: the GPTQ export holds 4-bit modules only, not 8-bit"]
