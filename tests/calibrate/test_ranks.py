"""Distributed calibration with real processes (gloo on 127.0.0.1): the ranks agree on every
Hessian a single process computes, give an equally good result, resume after a lost rank, and
the share arithmetic covers every window exactly once."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, save_byte_tokenizer, save_tiny_llama, whole_model_hessians
from hypothesis import given
from hypothesis import strategies as st

import quantizer.calibrate.capture as capture
from quantizer.calibrate.ranks import Ranks
from quantizer.calibrate.state import STATE_DIR
from quantizer.calibrate.windows import calibration_windows
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.text import builtin_text
from quantizer.io.tokenizer import load_tokenizer

TESTS = Path(__file__).resolve().parent.parent


@given(st.integers(1, 300), st.integers(1, 9))
def test_shares_cover_every_window_once_and_differ_by_at_most_one(count, world):
    slices = [Ranks(r, world).share(count) for r in range(world)]
    covered = [i for s in slices for i in range(count)[s]]
    assert covered == list(range(count))
    sizes = Ranks(0, world).shares(count)
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == count


@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=8), st.integers(1, 4))
def test_owners_balance_the_solves(sizes, world):
    owners = Ranks(0, world).owner_of(sizes)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
    assert all(0 <= o < world for o in owners)
    assert max(load) - min(load) <= max(sizes)  # greedy largest-first: within one job of even


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}


def start_ranks(world: int, argv: list, **popen) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, *map(str, argv)], env=rank_env(r, world, port), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
            for r in range(world)]


def finish(procs, timeout=300) -> list[tuple[int, str, str]]:
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outputs)]


@pytest.fixture(scope="module")
def tiny_four_layers(tmp_path_factory) -> Path:
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny4") / "bf16", num_hidden_layers=4,
                           max_position_embeddings=512)
    save_byte_tokenizer(path)
    return path


def test_two_ranks_agree_on_every_hessian(tiny_four_layers, tmp_path, monkeypatch):
    """The first step sees identical inputs in both runs: its Hessians agree to fp32 rounding.
    Every later step's inputs depend on weights already quantized, and past the first rounding
    tie that the two summation orders break differently (in layer 0's gate/up on some CPUs) the
    runs' weights differ, so every step is checked against the Hessian that a whole-model pass
    with the distributed run's own quantized weights gives."""
    single = []
    real_accumulate = capture.accumulate
    monkeypatch.setattr(capture, "accumulate", lambda *a, **k: single.append(real_accumulate(*a, **k)) or single[-1])
    sys.path.insert(0, str(TESTS))
    from dist_worker import OPTIONS
    from dist_worker import main as run_worker

    run_worker(tiny_four_layers, tmp_path / "one", tmp_path / "h-one.pt")
    results = finish(start_ranks(2, [TESTS / "dist_worker.py", tiny_four_layers, tmp_path / "two",
                                     tmp_path / "h-two.pt"]))
    assert all(rc == 0 for rc, _, _ in results), results
    merged = torch.load(tmp_path / "h-two.pt")
    first, H = single[0], merged[0]  # layer 0's q/k/v: its inputs depend on no rounding yet
    assert torch.allclose(H, first.H, rtol=1e-5, atol=1e-6 * first.H.abs().max().item())
    windows = calibration_windows(load_tokenizer(tiny_four_layers), builtin_text("calib"), OPTIONS.nsamples,
                                  OPTIONS.seqlen, OPTIONS.seed)
    reference = whole_model_hessians(tiny_four_layers, windows, CheckpointReader(tmp_path / "two"))
    assert len(reference) == len(merged) == 4 * 4 + 1
    for (name, H_ref), H in zip(reference.items(), merged):
        assert torch.allclose(H, H_ref, rtol=1e-4, atol=1e-5 * H_ref.abs().max().item()), name


def cli(*args):
    return ["-m", "quantizer", "quantize", *args]


def gptq_args(src, out, *extra):
    return cli("--model", src, "--out", out, "--method", "gptq", "--group-size", "64", "--nsamples", "6",
               "--seqlen", "64", *extra)


def test_torchrun_with_two_ranks_quantizes_as_well_as_one_and_records_the_world(tiny_four_layers, tmp_path):
    one = subprocess.run([sys.executable, *map(str, gptq_args(tiny_four_layers, tmp_path / "one"))], cwd=REPO,
                         capture_output=True, text=True, env=rank_env(0, 1, free_port()))
    assert one.returncode == 0, one.stderr
    torchrun = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port())]
    two = subprocess.run([sys.executable, *torchrun, *map(str, gptq_args(tiny_four_layers, tmp_path / "two")[1:])],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("quantized 30 tensors") == 1 and two.stderr.count("layer 4/4 quantized") == 1
    r1, r2 = (json.loads((tmp_path / d / "quantization_report.json").read_text()) for d in ("one", "two"))
    assert (r1["summary"]["world_size"], r2["summary"]["world_size"]) == (1, 2)
    assert r2["summary"]["windows_per_rank"] == [3, 3]
    assert len(r2["summary"]["calibration_peak_rss_mb_per_rank"]) == 2
    assert all(mb > 100 for mb in r2["summary"]["calibration_peak_rss_mb_per_rank"])
    assert set(r1["tensors"]) == set(r2["tensors"])
    solved = [name for name, e in r1["tensors"].items() if e["method"] == "gptq"]
    assert len(solved) == 4 * 7 + 1
    assert all(r2["tensors"][n]["gptq_loss"] < r2["tensors"][n]["rtn_loss"] for n in solved)
    total1, total2 = (sum(r["tensors"][n]["gptq_loss"] for n in solved) for r in (r1, r2))
    assert total2 == pytest.approx(total1, rel=0.01)
    assert not list(tmp_path.glob(".*int4q-partial"))


def test_a_killed_rank_stops_the_run_with_one_line_and_the_run_resumes(tiny_four_layers, tmp_path):
    out = tmp_path / "q"
    procs = start_ranks(2, gptq_args(tiny_four_layers, out))
    for line in procs[0].stderr:  # rank 0 reports each finished layer
        if "layer 1/4 quantized" in line:
            procs[1].send_signal(signal.SIGKILL)
            break
    rc0 = procs[0].wait(timeout=300)
    err0 = procs[0].stderr.read()
    procs[1].wait(timeout=60)
    errors = [line for line in err0.splitlines() if line.startswith("Error:")]
    assert rc0 != 0 and len(errors) == 1, err0
    assert "rank 1 stopped" in errors[0] and "--resume" in errors[0] and "Traceback" not in err0
    assert not out.exists()
    state = json.loads((tmp_path / ".q.int4q-partial" / STATE_DIR / "state.json").read_text())
    assert 1 <= state["layers_done"] < 4

    resumed = finish(start_ranks(2, gptq_args(tiny_four_layers, out, "--resume")))
    assert all(rc == 0 for rc, _, _ in resumed), resumed
    assert f"resuming after layer {state['layers_done']}/4" in resumed[0][2]
    clean = finish(start_ranks(2, gptq_args(tiny_four_layers, tmp_path / "clean")))
    assert all(rc == 0 for rc, _, _ in clean), clean
    for shard in out.glob("*.safetensors"):
        assert shard.read_bytes() == (tmp_path / "clean" / shard.name).read_bytes(), shard.name


def test_a_resume_with_another_world_size_is_refused(tiny_four_layers, tmp_path):
    out = tmp_path / "q"
    procs = start_ranks(2, gptq_args(tiny_four_layers, out))
    for line in procs[0].stderr:
        if "layer 1/4 quantized" in line:
            for p in procs:
                p.send_signal(signal.SIGKILL)
            break
    finish(procs)
    one = subprocess.run([sys.executable, *map(str, gptq_args(tiny_four_layers, out, "--resume"))], cwd=REPO,
                         capture_output=True, text=True, env=rank_env(0, 1, free_port()))
    assert one.returncode == 1 and "different inputs or settings" in one.stderr
