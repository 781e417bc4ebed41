"""Progress on stderr: plain lines with rate and ETA off a terminal (one as a step starts, one per
unit, one per interval for bytes, and one at least every interval while a unit runs long), a tqdm
bar on one."""

import re
import time

import quantizer.cli.progress as cli_progress
from quantizer.cli.progress import StepReporter, Steps


def test_off_a_terminal_each_step_is_one_plain_line_with_rate_and_eta(capsys):
    report = StepReporter(unit="layer")
    report("layer", 1, 4)  # resumed after one layer: the clock starts here, with a line saying so
    for done in range(2, 5):
        time.sleep(0.01)
        report("layer", done, 4, f"quantized in 0.{done} s")
    start, *lines = capsys.readouterr().err.splitlines()
    assert start == "int4q: layer 1/4 (starting)"
    assert len(lines) == 3 and lines[0].startswith("int4q: layer 2/4 quantized in 0.2 s (")
    assert all(re.search(r"\(\d+\.\d\d layer/s, ETA \d+ s\)$", line) for line in lines)
    assert lines[-1].endswith("ETA 0 s)") and report.open == {}


def test_slow_steps_show_seconds_per_step(capsys):
    steps = Steps("layer", 3, unit="layer")
    steps.started -= 120  # as if the first layer took two minutes
    steps.update(1)
    steps.close()
    assert "(120.0 s/layer, ETA 240 s)" in capsys.readouterr().err


def test_byte_counts_print_a_line_per_interval_and_the_last(capsys):
    steps = Steps("quantize", 1000, unit="B", interval=0.2)
    for done in range(10, 1001, 10):
        steps.update(done)
        if done == 500:
            time.sleep(0.25)
    steps.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("(starting)") and all("MB/s" in line for line in lines[1:])
    assert 3 <= len(lines) <= 5  # not one per update: the start, one for the pause, the end


def test_a_long_unit_gets_a_line_every_interval_with_how_long_it_has_run(capsys):
    steps = Steps("layer", 2, unit="layer", interval=0.05)
    time.sleep(0.3)
    steps.update(1)
    steps.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "int4q: layer 0/2 (starting)" and lines[-1].startswith("int4q: layer 1/2 (")
    beats = [line for line in lines if "running for" in line]
    assert 2 <= len(beats) <= 6 and beats[0].startswith("int4q: layer 0/2 running for ")


def test_a_step_forgotten_unclosed_stops_its_lines(capsys):
    import gc

    steps = Steps("layer", 2, unit="layer", interval=0.05)
    del steps
    gc.collect()
    capsys.readouterr()
    time.sleep(0.2)
    assert capsys.readouterr().err == ""


def test_disabled_progress_prints_nothing(capsys):
    StepReporter(enabled=False)("layer", 1, 1)
    assert capsys.readouterr().err == ""


def test_on_a_terminal_it_is_a_tqdm_bar(capsys, monkeypatch):
    monkeypatch.setattr(cli_progress, "is_terminal", lambda: True)
    report = StepReporter(unit="window")
    report("KLD windows", 1, 2)
    report("KLD windows", 2, 2)
    err = capsys.readouterr().err
    assert "KLD windows" in err and "2/2" in err and "window/s" in err and "int4q:" not in err
