"""Calibration windows: seeded, reproducible, and a clear error for too little text."""

import pytest
import torch

from quantizer.calibrate.windows import calibration_windows
from quantizer.errors import InputError
from quantizer.io.text import builtin_text


def test_windows_are_seeded_and_reproducible(byte_tokenizer):
    text = builtin_text("calib")
    a = calibration_windows(byte_tokenizer, text, 6, 64, seed=1)
    b = calibration_windows(byte_tokenizer, text, 6, 64, seed=1)
    c = calibration_windows(byte_tokenizer, text, 6, 64, seed=2)
    assert a.shape == (6, 64) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_too_little_text_is_a_clear_error(byte_tokenizer):
    with pytest.raises(InputError, match="calibration text has 5 tokens"):
        calibration_windows(byte_tokenizer, "short", 4, 64)
