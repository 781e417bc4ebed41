"""Progress on stderr: plain lines with rate and ETA off a terminal (one per tenth for bytes), a
tqdm bar on one."""

import re

import quantizer.cli_progress as cli_progress
from quantizer.cli_progress import StepReporter, Steps


def test_off_a_terminal_each_step_is_one_plain_line_with_rate_and_eta(capsys):
    report = StepReporter(unit="layer")
    for done in range(1, 4):
        report("layer", done, 3, f"quantized in 0.{done} s")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[0].startswith("int4q: layer 1/3 quantized in 0.1 s (")
    assert all(re.search(r"\(\d+\.\d\d layer/s, ETA \d+ s\)$", line) for line in lines)
    assert lines[-1].endswith("ETA 0 s)") and report.open == {}


def test_byte_counts_print_at_most_one_line_per_tenth(capsys):
    steps = Steps("quantize", 1000, unit="B", every=0.1)
    for done in range(10, 1001, 10):
        steps.update(done)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and "MB/s" in lines[0]


def test_disabled_progress_prints_nothing(capsys):
    StepReporter(enabled=False)("layer", 1, 1)
    assert capsys.readouterr().err == ""


def test_on_a_terminal_it_is_a_tqdm_bar(capsys, monkeypatch):
    monkeypatch.setattr(cli_progress, "_is_terminal", lambda: True)
    report = StepReporter(unit="window")
    report("KLD windows", 1, 2)
    report("KLD windows", 2, 2)
    err = capsys.readouterr().err
    assert "KLD windows" in err and "2/2" in err and "window/s" in err and "int4q:" not in err
