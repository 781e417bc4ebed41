import json

import pytest
import torch

from quantizer.calibration import calibration_windows
from quantizer.errors import InputError
from quantizer.textdata import builtin_text, load_text, read_text_file


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


def test_builtin_halves_are_disjoint_and_large():
    calib, evaluation = builtin_text("calib"), builtin_text("eval")
    assert len(calib) > 100_000 and len(evaluation) > 100_000
    assert calib[:2000] not in evaluation and evaluation[:2000] not in calib


def test_jsonl_text_field_and_errors(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"text": "alpha"}) + "\n\n" + json.dumps({"text": "beta"}) + "\n")
    assert read_text_file(good) == "alpha\n\nbeta"
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(InputError, match="b.jsonl:1: a JSON Lines record needs a string 'text' field"):
        read_text_file(bad)
    empty = tmp_path / "e.txt"
    empty.write_text("  \n")
    with pytest.raises(InputError, match="no text"):
        read_text_file(empty)


def test_default_text_names_its_source():
    text, origin = load_text(None, "eval")
    assert origin == "pydoc_data.topics (eval half)" and text == builtin_text("eval")
