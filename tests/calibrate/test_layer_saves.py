"""Each layer's state is written behind the next layer in one process, in order and one at a
time; a failed write is raised to the caller; across processes the writes are the caller's own."""

import threading

import pytest

import quantizer.calibrate.state as state
from quantizer.calibrate.ranks import Ranks


@pytest.fixture
def gated_saves(monkeypatch):
    """save_layer replaced: each call records (its layer, its thread) and waits for the gate."""
    gate, calls = threading.Event(), []

    def save_layer(state_dir, fp, layers_done, *rest, **kwargs):
        calls.append((layers_done, threading.current_thread() is threading.main_thread()))
        if not gate.wait(timeout=10):
            raise TimeoutError("the gate never opened")
        if layers_done == 99:
            raise OSError("disk full")

    monkeypatch.setattr(state, "save_layer", save_layer)
    return gate, calls


def test_a_save_runs_behind_the_caller_and_the_next_waits_for_it(gated_saves):
    gate, calls = gated_saves
    with state.LayerSaves() as saves:
        saves.save("dir", "fp", 1)
        assert not gate.is_set()  # returned while the write cannot finish: it is in flight
        threading.Timer(0.2, gate.set).start()
        saves.save("dir", "fp", 2)  # blocks until the first is written
        assert calls[0] == (1, False)
    assert calls == [(1, False), (2, False)]


def test_a_failed_save_is_raised_when_the_caller_waits(gated_saves):
    gate, _ = gated_saves
    gate.set()
    with pytest.raises(OSError, match="disk full"):
        with state.LayerSaves() as saves:
            saves.save("dir", "fp", 99)


def test_across_processes_each_save_is_made_in_the_callers_thread(gated_saves):
    gate, calls = gated_saves
    gate.set()
    with state.LayerSaves(Ranks(rank=0, world_size=2)) as saves:
        saves.save("dir", "fp", 1)
        assert calls == [(1, True)]
