"""The native step over row-major linears (``w4a8_rows``, as on AVX2 CPUs, whose tinygemm layout
int4q does not decode) is the eager int8 step bit for bit and takes a prompt as single steps."""

import pytest
import torch
from conftest import quantize_to
from test_native_step import (
    INT8,
    INT8_DECODE,
    greedy_logits,
    greedy_logits_from,
    save_tiny,
)

import quantizer.runtime.nn.int4 as int4_modules
from quantizer.runtime import load_model
from quantizer.runtime.decode import native_step as native
from quantizer.runtime.decode.decoder import FastDecoder
from quantizer.runtime.kernels.w4a8_rows import ROWS_LIMIT, has_w4a8_rows
from quantizer.runtime.nn.int4 import Int4Linear

pytestmark = pytest.mark.skipif(not has_w4a8_rows(), reason="this CPU has no AVX2 + FMA: no row-major int8 kernel")


@pytest.fixture
def row_major(monkeypatch):
    """Linears keep row-major copies and decode from them (w4a8_rows), as on a CPU whose tinygemm
    layout int4q does not decode (AVX2)."""
    monkeypatch.setattr(int4_modules, "kernel_layout_matches", lambda n: False)
    monkeypatch.setattr(int4_modules, "_warned_layout", True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_row_major_linears_step_as_eager_and_take_prompts_as_single_steps(kind, tmp_path, row_major):
    path = quantize_to(save_tiny(kind, tmp_path / "bf16"), tmp_path / "int4", group_size=64)
    prompt = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(3))
    decoder = FastDecoder(load_model(path, activations=INT8_DECODE), 64)
    assert all(m.packed is not None for m in decoder.layers.modules() if isinstance(m, Int4Linear))
    step = native.native_step(decoder)
    assert step is not None and step.rows == 1 and step.spec.kernels() == {"w4a8_rows"}
    decoder.native = None
    eager = greedy_logits(decoder, prompt, 12)
    decoder.native = step
    assert torch.equal(greedy_logits(decoder, prompt, 12), eager)

    decoder = FastDecoder(load_model(path, activations=INT8), 64)
    assert native.native_step(decoder).rows == ROWS_LIMIT
    whole = greedy_logits(decoder, prompt, 6)
    decoder.reset()
    for i in range(prompt.shape[1] - 1):
        decoder.forward(prompt[:, i : i + 1])
    assert torch.equal(greedy_logits_from(decoder, prompt[:, -1:], 6), whole)
