"""The compiled decode step without the wait: decoding starts eagerly at once, and takes the
step between two tokens once a background process (or an earlier run) has saved it."""

import logging
import os
import time

import pytest
import torch
from click.testing import CliRunner

from quantizer.cli.main import main
from quantizer.integrity import record_digest
from quantizer.runtime import load_model
from quantizer.runtime.decode import background, opening
from quantizer.runtime.decode import compiled as fastpath
from quantizer.runtime.decode.generation import fast_greedy

IDS = torch.tensor([[1, 5, 9]])
TOKENS = 24


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this module's own (the background process reads the environment)."""
    before = os.environ.get("INT4Q_CACHE_DIR")
    os.environ["INT4Q_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    os.environ.pop("INT4Q_CACHE_DIR") if before is None else os.environ.update(INT4Q_CACHE_DIR=before)


@pytest.fixture
def model(tiny_model, cache, monkeypatch):
    monkeypatch.setattr(fastpath, "checked_steps", {})  # as in a fresh process
    return load_model(tiny_model)


def eager_tokens(model):
    return list(fast_greedy(opening.open_decoder(model, 64, compile=False), IDS, TOKENS, set()))


def test_a_first_run_decodes_eagerly_while_a_background_process_compiles_the_step(model, tiny_model, caplog):
    threads = torch.get_num_threads()
    with caplog.at_level(logging.WARNING):
        decoder = opening.open_decoder(model, 64, source=tiny_model)
    assert decoder.compiled is None and decoder.pending.worker is not None
    assert "decoding eagerly while the decode step compiles in the background (about" in caplog.text
    assert list(fast_greedy(decoder, IDS, TOKENS, set())) == eager_tokens(model)
    assert decoder.pending.worker.wait(timeout=900) == 0
    assert decoder.pending.wait(timeout=300) is not None
    assert list(fast_greedy(decoder, IDS, TOKENS, set())) == eager_tokens(model)
    assert decoder.compiled is not None and decoder.pending is None
    assert torch.get_num_threads() == threads  # lent to the worker's core while it compiled, then given back


def test_a_later_run_reads_the_saved_step_in_a_thread_and_compiles_nothing(model, tiny_model, monkeypatch):
    monkeypatch.setattr(fastpath, "_aot_compile", lambda d: pytest.fail("compiled again"))
    monkeypatch.setattr(background, "start_worker", lambda *a: pytest.fail("started a compile"))
    decoder = opening.open_decoder(model, 64, source=tiny_model)
    assert decoder.pending is not None and decoder.pending.worker is None
    assert decoder.pending.wait(timeout=300) is not None
    assert list(fast_greedy(decoder, IDS, TOKENS, set())) == eager_tokens(model)
    assert decoder.compiled is not None


def test_int4q_compile_saves_the_step_ahead_once(tiny_model, cache):
    result = CliRunner().invoke(main, ["compile", str(tiny_model), "--threads", str(torch.get_num_threads())])
    assert result.exit_code == 0 and "decode step already saved: " in result.output, result.output


def test_a_compile_under_way_is_not_started_twice(model, tiny_model, monkeypatch):
    monkeypatch.setattr(fastpath, "_aot_compile", lambda d: pytest.fail("compiled while another compile ran"))
    artifact = fastpath.artifact_path(model)
    with background.exclusive(artifact) as held:
        assert held
        assert background.compile_and_save(tiny_model, torch.get_num_threads(), 64) == (artifact, "being compiled")


def test_a_run_that_finds_a_compile_under_way_starts_no_second_one(model, tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(background, "start_worker", lambda *a: pytest.fail("started a second compile"))
    monkeypatch.setattr(fastpath, "_warned", set())
    artifact = fastpath.compiled_dir() / "under-way.aot"
    monkeypatch.setattr(fastpath, "artifact_path", lambda m, variant="": artifact)
    threads = torch.get_num_threads()
    with background.exclusive(artifact) as held, caplog.at_level(logging.WARNING):
        assert held and not background.saved_step_ready(artifact)
        decoder = opening.open_decoder(model, 64, source=tiny_model)
        assert decoder.pending is not None and decoder.pending.worker is None
        assert "while another int4q run compiles it in the background" in caplog.text
        lent = threads >= len(os.sched_getaffinity(0))  # the other run's worker has a core of its own
        assert torch.get_num_threads() == (max(1, threads - 1) if lent else threads)
        assert decoder.pending.wait(timeout=1) is None and not decoder.pending.finished
    assert decoder.pending.wait(timeout=30) is None and decoder.pending.finished  # it ended with no step saved
    assert torch.get_num_threads() == threads
    assert list(fast_greedy(decoder, IDS, TOKENS, set())) == eager_tokens(model)


def test_a_worker_waits_for_a_compile_under_way_and_then_loads_nothing(tiny_model, monkeypatch):
    import threading

    artifact = fastpath.compiled_dir() / "waited.aot"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(background, "_decoder_of", lambda *a: pytest.fail("loaded the model"))
    released = threading.Event()

    def other_compile():
        with background.exclusive(artifact) as held:
            assert held
            released.wait(5)
            artifact.write_bytes(b"saved by the other run")
            record_digest(artifact)

    other = threading.Thread(target=other_compile)
    other.start()
    time.sleep(0.2)
    timer = threading.Timer(0.5, released.set)
    timer.start()
    started = time.monotonic()
    assert background.compile_and_save(tiny_model, 2, 64, artifact) == (artifact, "already saved")
    assert time.monotonic() - started >= 0.4
    other.join()


def test_an_unusable_saved_step_is_removed_and_compiled_again(model, tiny_model, monkeypatch):
    artifact = fastpath.artifact_path(model)
    artifact.write_bytes(b"not a compiled function")
    record_digest(artifact)
    restarted = []
    monkeypatch.setattr(background, "start_worker", lambda source, path, max_len: restarted.append(path))
    decoder = opening.open_decoder(model, 64, source=tiny_model)
    assert decoder.pending.wait(timeout=60) is None
    assert restarted == [artifact] and not artifact.exists()
    assert list(fast_greedy(decoder, IDS, TOKENS, set())) == eager_tokens(model) and decoder.compiled is None


def test_a_step_that_does_not_compile_is_not_compiled_again_by_later_runs(model, tiny_model, monkeypatch):
    def broken(decoder):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fastpath, "_warned", set())
    monkeypatch.setattr(fastpath, "artifact_path", lambda m, variant="": fastpath.compiled_dir() / "broken.aot")
    monkeypatch.setattr(fastpath, "_aot_compile", broken)
    assert opening.open_decoder(model, 64).compiled is None
    assert "no C++ compiler" in (fastpath.compiled_dir() / "broken.failed").read_text()
    monkeypatch.setattr(background, "start_worker", lambda *a: pytest.fail("started a compile"))
    decoder = opening.open_decoder(model, 64, source=tiny_model)
    assert decoder.compiled is None and decoder.pending is None
    assert list(fast_greedy(decoder, IDS, TOKENS, set())) == eager_tokens(model)


def test_int4q_compile_of_a_step_that_does_not_compile_is_one_line_naming_the_marker(model, tiny_model,
                                                                                   monkeypatch):
    def broken(decoder):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fastpath, "artifact_path", lambda m, variant="": fastpath.compiled_dir() / "cli-broken.aot")
    monkeypatch.setattr(fastpath, "_aot_compile", broken)
    monkeypatch.setattr(fastpath, "_warned", set())  # this process's once-only warnings stay as they were
    result = CliRunner().invoke(main, ["compile", str(tiny_model)])
    assert result.exit_code != 0 and "Traceback" not in result.output and "internal error" not in result.output
    assert "does not compile" in result.output and "cli-broken.failed" in result.output


def test_a_short_generation_decodes_eagerly_unless_told_to_compile(tiny_model_tok, cache, monkeypatch):
    monkeypatch.setattr(fastpath, "checked_steps", {})
    monkeypatch.setattr(opening, "_step_in_background", lambda *a: pytest.fail("read or compiled a step"))
    monkeypatch.setattr(fastpath, "compile_step", lambda *a: pytest.fail("compiled a step"))
    args = ["generate", str(tiny_model_tok), "--prompt", "def f(x):", "--max-new-tokens", "8"]
    short = CliRunner().invoke(main, args)
    assert short.exit_code == 0, short.output
    asked = []
    monkeypatch.setattr(opening, "_step_in_background", lambda decoder, artifact, source: asked.append(source))
    forced = CliRunner().invoke(main, [*args, "--compile"])
    assert forced.exit_code == 0 and asked == [tiny_model_tok], forced.output
