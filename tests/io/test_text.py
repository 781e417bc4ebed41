"""Text without a download: the built-in halves, user files in plain text or JSON Lines."""

import json

import pytest

from quantizer.errors import InputError
from quantizer.io.text import builtin_text, load_text, read_text_file


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


def test_an_unknown_split_and_a_missing_file_are_named(tmp_path):
    with pytest.raises(ValueError, match="split must be 'calib' or 'eval'"):
        builtin_text("train")
    with pytest.raises(InputError, match="nope.txt: no such file"):
        read_text_file(tmp_path / "nope.txt")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(InputError, match="bad.jsonl:1: not valid JSON"):
        read_text_file(tmp_path / "bad.jsonl")


def test_a_text_file_is_read_only_as_far_as_its_budget_at_a_line_break(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100_000)))
    text = read_text_file(path, max_bytes=1000)
    assert len(text.encode()) <= 1000 and text.endswith("\n") and text.startswith("line 0\n")
    assert read_text_file(path) == path.read_text()


def test_a_device_that_never_ends_is_read_only_to_its_budget():
    text = read_text_file("/dev/zero", max_bytes=1 << 16)
    assert len(text) == 1 << 16


def test_a_cut_inside_a_character_keeps_only_whole_characters(tmp_path):
    path = tmp_path / "one-line.txt"
    path.write_bytes("é".encode() * 1000)
    assert read_text_file(path, max_bytes=1001) == "é" * 500


def test_calibration_reads_no_more_text_than_its_windows_need(tmp_path):
    from quantizer.io.text import MIN_TEXT_BYTES, text_budget

    assert text_budget(4 * 64) == MIN_TEXT_BYTES and text_budget(128 * 512) == 64 * 128 * 512
