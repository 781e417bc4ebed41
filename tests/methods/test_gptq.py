import logging

import pytest
import torch

from quantizer.methods.gptq import HessianAccumulator, gptq_quantize, proxy_loss
from quantizer.methods.grid import grid_params, quantize_groupwise


def correlated_inputs(k, rows=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) @ (torch.randn(k, k, generator=g) * 0.2 + torch.eye(k))
    x[:, :3] *= 8  # a few dominant input channels, as real activations have
    return x


def test_hessian_accumulator_is_two_over_n_xtx_across_batches():
    x = torch.randn(300, 16, dtype=torch.float64).float()
    acc = HessianAccumulator(16)
    for chunk in x.split(70):
        acc.add(chunk)
    assert torch.allclose(acc.H, 2 / 300 * x.t() @ x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_gptq_beats_rtn_on_its_calibration_objective(symmetric, act_order, group):
    k = 256
    W = torch.randn(96, k, generator=torch.Generator().manual_seed(1)) * 0.05
    acc = HessianAccumulator(k)
    acc.add(correlated_inputs(k))
    gq, info = gptq_quantize(W, acc.H, group, symmetric=symmetric, act_order=act_order)
    rtn = quantize_groupwise(W, group, symmetric=symmetric)
    assert gq.codes.dtype == torch.uint8 and int(gq.codes.max()) <= 15
    assert proxy_loss(W, gq.dequantize(), acc.H) < 0.7 * proxy_loss(W, rtn.dequantize(), acc.H)
    assert info.retries == 0 and info.dead_columns == 0


def test_act_order_keeps_static_groups_from_the_original_weights():
    k = 128
    W = torch.randn(32, k, generator=torch.Generator().manual_seed(2)) * 0.05
    acc = HessianAccumulator(k)
    acc.add(correlated_inputs(k))
    gq, _ = gptq_quantize(W, acc.H, 32, act_order=True)
    g = W.reshape(32, 4, 32)
    scale, zero = grid_params(g.amin(-1), g.amax(-1), symmetric=False)
    assert torch.equal(gq.scale, scale) and torch.equal(gq.zero, zero)


def test_symmetric_gptq_has_zero_offsets():
    W = torch.randn(16, 64) * 0.05
    acc = HessianAccumulator(64)
    acc.add(torch.randn(256, 64))
    gq, _ = gptq_quantize(W, acc.H, 32, symmetric=True)
    assert torch.all(gq.zero == 0)


def test_dead_columns_are_handled():
    k = 64
    x = torch.randn(512, k)
    x[:, [3, 40]] = 0
    acc = HessianAccumulator(k)
    acc.add(x)
    gq, info = gptq_quantize(torch.randn(32, k) * 0.05, acc.H, 32)
    assert info.dead_columns == 2
    assert torch.isfinite(gq.scale.float()).all() and torch.isfinite(gq.dequantize()).all()


def test_failed_cholesky_retries_with_more_damping_and_warns(caplog):
    H = torch.diag(torch.tensor([1.0] * 31 + [-0.02]))
    with caplog.at_level(logging.WARNING):
        gq, info = gptq_quantize(torch.randn(16, 32) * 0.05, H, 32, act_order=False)
    assert info.retries == 1 and info.damp == pytest.approx(0.1)
    assert "--damp" in caplog.text


def test_hessian_beyond_repair_is_an_error():
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(torch.randn(16, 32), -torch.eye(32), 32)


def test_row_chunks_give_the_same_result(monkeypatch):
    import quantizer.methods.gptq as gptq

    k = 64
    W = torch.randn(40, k, generator=torch.Generator().manual_seed(3))
    acc = HessianAccumulator(k)
    acc.add(correlated_inputs(k))
    whole, _ = gptq_quantize(W, acc.H, 32)
    monkeypatch.setattr(gptq, "ROW_CHUNK", 16)
    chunked, _ = gptq_quantize(W, acc.H, 32)
    assert torch.equal(whole.codes, chunked.codes) and torch.equal(whole.scale, chunked.scale)
