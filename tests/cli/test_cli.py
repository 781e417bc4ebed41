import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import interrupt_gptq_at_second_layer, quantize_to

from quantizer.cli.main import main


def run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def assert_one_line_error(result, pattern, code=1):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and pattern in lines[0], result.stderr


def test_quantize_two_shard_model_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_model, "--out", out, "--group-size", "64", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "quantized 15 tensors at group 64" in result.stdout and "peak RSS" in result.stdout
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["group_size"] == 64 and config["quant_method"] == "cpu_int4"
    assert (out / "quantization_report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_existing_output_is_refused_without_overwrite(tiny_model, tmp_path):
    (tmp_path / "q").mkdir()
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q")
    assert result.exit_code == 2 and "--overwrite" in result.stderr


def test_missing_config_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    assert_one_line_error(run("quantize", "--model", tmp_path / "m", "--out", tmp_path / "q"), "no config.json")
    assert not (tmp_path / "q").exists()


def test_group_size_error_writes_nothing(tiny_model, tmp_path):
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--group-size", "256", "--strict-group-size")
    assert_one_line_error(result, "group size 256 does not divide")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_run_leaves_no_output(tiny_model, tmp_path, monkeypatch):
    import quantizer.methods.rtn as rtn

    real, calls = rtn.quantize_rtn, []

    def interrupt_on_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(rtn, "quantize_rtn", interrupt_on_fifth)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_unexpected_failure_is_one_line_without_traceback(tiny_model, tmp_path, monkeypatch):
    import quantizer.methods.rtn as rtn

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(rtn, "quantize_rtn", broken)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, "internal error: RuntimeError: kernel exploded")
    assert list(tmp_path.iterdir()) == []


def test_hub_id_when_offline_is_a_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "quantizer", "quantize", "--model", "someone/not-here", "--out", str(tmp_path / "q")],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "someone/not-here: not a local folder and could not be fetched from the Hub" in proc.stderr


def edited_copy(src, dst, edit_config=None, edit_index=None):
    import shutil

    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(edit_config(config)))
    if edit_index:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        (dst / "model.safetensors.index.json").write_text(json.dumps(edit_index(index)))
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda c: {**c, "intermediate_size": 320}, "the model expects [320, 128]"),
    (lambda c: {**c, "num_hidden_layers": 1}, "model.layers.1.input_layernorm.weight: stray tensor"),
    (lambda c: [c], "holds a JSON list, not an object"),
    (lambda c: {**c, "model_type": "no-such-model"}, "cannot build model_type 'no-such-model' (an unknown model type)"),
])
def test_a_config_that_does_not_describe_the_weights_is_one_line(tiny_model, tmp_path, edit, message):
    bad = edited_copy(tiny_model, tmp_path / "bad", edit_config=edit)
    result = run("quantize", "--model", bad, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, message)
    assert len(result.stderr) < 400 and not (tmp_path / "q").exists()


def test_an_index_naming_a_tensor_no_shard_holds_is_one_line(tiny_model, tmp_path):
    def add_ghost(index):
        index["weight_map"]["model.ghost.weight"] = sorted(index["weight_map"].values())[0]
        return index

    bad = edited_copy(tiny_model, tmp_path / "bad", edit_index=add_ghost)
    result = run("quantize", "--model", bad, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, "places model.ghost.weight in")


def test_too_little_free_space_is_refused_before_any_work(tiny_model, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--no-progress")
    assert_one_line_error(result, f"{tmp_path} has 1.00 kB free, but writing q needs about")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_mid_write_is_one_line_on_its_own_line(tiny_model, tmp_path, monkeypatch):
    import errno

    import quantizer.io.shards as shards

    def full(f, offset, tensor):
        raise OSError(errno.ENOSPC, "No space left on device", f.name)

    monkeypatch.setattr(shards, "_write_tensor", full)
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q")  # with the progress bar
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if "no space left" in line]
    assert len(error) == 1 and error[0].startswith("Error: no space left on the device while writing ")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_gptq_run_says_what_it_kept_and_how_to_resume(tiny_model_tok, tmp_path, monkeypatch):
    interrupt_gptq_at_second_layer(monkeypatch)
    result = run("quantize", "--model", tiny_model_tok, "--out", tmp_path / "g", "--method", "gptq",
                 "--nsamples", 2, "--seqlen", 32, "--no-progress")
    assert result.exit_code == 130
    assert "interrupted; the finished layers are kept in" in result.stderr and "--resume" in result.stderr


def test_generate_refuses_an_empty_prompt(tiny_q):
    result = run("generate", tiny_q, "--prompt", "  ")
    assert result.exit_code == 2 and "the prompt is empty" in result.stderr


def test_bench_json_into_a_missing_folder_is_refused_before_measuring(tiny_q, tmp_path):
    result = run("bench", tiny_q, "--json", tmp_path / "nope" / "b.json")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_bench_without_prefill(tiny_q, tmp_path):
    from quantizer.runtime.kernels.w4a8 import has_w4a8

    result = run("bench", tiny_q, "--prompt-tokens", 0, "--gen-tokens", 3, "--reps", 1, "--no-compile",
                 "--decode", "int8", "--json", tmp_path / "b.json")
    assert result.exit_code == 0, result.output
    arm = json.loads((tmp_path / "b.json").read_text())["arms"]["int4"]
    # int8 decode takes the native step where the CPU has the VNNI kernel; nothing else compiles here
    assert arm["pp_median"] is None and arm["tg_median"] > 0
    assert arm["decode_path"] == ("native" if has_w4a8() else "eager")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_keeps_the_finished_layers_and_says_so_like_ctrl_c(tiny_model_tok, tmp_path, monkeypatch, signum):
    import quantizer.quantization.layerwise as layerwise
    from quantizer.io.outdir import partial_dir

    real = layerwise._materialize

    def stop_at_layer_one(module, prefix, *a, **k):
        if prefix.endswith("layers.1"):
            os.kill(os.getpid(), signum)
        return real(module, prefix, *a, **k)

    monkeypatch.setattr(layerwise, "_materialize", stop_at_layer_one)
    out, before = tmp_path / "q", signal.getsignal(signum)
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out), "--method",
                                       "gptq", "--nsamples", "2", "--seqlen", "64", "--no-progress"])
    assert result.exit_code == 128 + signum, result.output
    lines = [line for line in result.stderr.splitlines() if "stopped by" in line]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0] and "--resume" in lines[0]
    assert not out.exists() and partial_dir(out).exists() and "Traceback" not in result.output
    assert signal.getsignal(signum) is before  # the handler is the test process's own again
    monkeypatch.setattr(layerwise, "_materialize", real)
    resumed = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out), "--method",
                                        "gptq", "--nsamples", "2", "--seqlen", "64", "--no-progress", "--resume"])
    assert resumed.exit_code == 0, resumed.output


def test_a_push_stopped_by_a_signal_removes_the_card_it_wrote(tiny_model_tok, tmp_path, monkeypatch):
    import quantizer.hub.push as push

    out = tmp_path / "q"
    assert CliRunner().invoke(main, ["quantize", "--model", str(tiny_model_tok), "--out", str(out),
                                     "--no-progress"]).exit_code == 0
    monkeypatch.setattr(push, "_upload", lambda *a, **k: os.kill(os.getpid(), signal.SIGHUP))
    result = CliRunner().invoke(main, ["push", str(out), "--repo-id", "a/b", "--endpoint", "http://127.0.0.1:9"])
    assert result.exit_code == 128 + signal.SIGHUP, result.output
    assert "stopped by SIGHUP" in result.stderr and not (out / "README.md").exists()


def test_a_shard_size_of_zero_is_bad_usage_naming_the_option(tiny_model, tmp_path):
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(tmp_path / "q"),
                                       "--max-shard-size", "0"])
    assert result.exit_code == 2 and "--max-shard-size" in result.output and "positive" in result.output
    assert not (tmp_path / "q").exists()


def test_a_repo_id_that_escapes_its_namespace_is_refused_before_any_check(tmp_path):
    result = CliRunner().invoke(main, ["push", str(tmp_path), "--repo-id", "../evil"])
    assert result.exit_code == 2 and "--repo-id" in result.output and "structural" not in result.output


def test_a_decode_only_bench_prints_no_prefill_numbers(tiny_model_tok):
    result = CliRunner().invoke(main, ["bench", str(tiny_model_tok), "--prompt-tokens", "0", "--gen-tokens", "4",
                                       "--reps", "1", "--no-compile"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if "tg " in line and "RssAnon" in line)
    assert "pp " not in line and "None" not in result.stdout


def test_generate_stats_are_printed_when_decoding_falls_back_to_transformers(tmp_path, monkeypatch):
    from conftest import save_byte_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from quantizer.runtime.decode import compiled

    monkeypatch.setattr(compiled, "_warned", set())  # this process's once-only warnings stay as they were
    monkeypatch.setattr(GPT2LMHeadModel, "_can_compile_fullgraph", False)  # as for a model with no static cache

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=2, n_positions=256)).save_pretrained(src)
    save_byte_tokenizer(src)
    result = CliRunner().invoke(main, ["generate", str(src), "--prompt", "def f(x):", "--max-new-tokens", "5",
                                       "--stats", "--no-compile"])
    assert result.exit_code == 0, result.output
    stats = [line for line in result.stderr.splitlines() if "time to first token" in line]
    assert len(stats) == 1 and "(9 prompt tokens), then " in stats[0] and " tokens at " in stats[0], result.stderr


def test_a_damaged_saved_layer_is_found_when_resuming_starts_and_never_advises_resume(tiny_model_tok, tmp_path,
                                                                                      monkeypatch):
    import quantizer.quantization.layerwise as layerwise
    from quantizer.calibrate.state import STATE_DIR, layer_file
    from quantizer.io.outdir import partial_dir

    restore = interrupt_gptq_at_second_layer(monkeypatch)
    args = ("quantize", "--model", tiny_model_tok, "--out", tmp_path / "g", "--method", "gptq", "--nsamples", 2,
            "--seqlen", 32, "--no-progress")
    assert run(*args).exit_code == 130
    restore()
    saved = layer_file(partial_dir(tmp_path / "g") / STATE_DIR, 0)
    saved.write_bytes(saved.read_bytes()[:-64])
    monkeypatch.setattr(layerwise, "_quantize_layer", lambda *a, **k: pytest.fail("redid a layer before checking"))
    result = run(*args, "--resume")
    assert result.exit_code == 1 and "the saved state in" in result.stderr and "was changed after int4q wrote it" \
        in result.stderr
    assert "rerun without --resume" in result.stderr and "--resume to continue" not in result.stderr


@pytest.mark.parametrize("artefact", ["layer", "hidden", "importance", "state.json"])
def test_a_resume_refuses_saved_state_changed_after_int4q_wrote_it(tiny_model_tok, tmp_path, monkeypatch, artefact):
    """Bytes flipped inside a finished layer, the hidden states or state.json's report fields (the
    file still parses) are found before any work, by the sha256 recorded when each was written."""
    import quantizer.quantization.layerwise as layerwise
    from quantizer.calibrate.state import (
        STATE_DIR,
        hidden_file,
        importance_file,
        layer_file,
    )
    from quantizer.io.outdir import partial_dir

    restore = interrupt_gptq_at_second_layer(monkeypatch)
    args = ("quantize", "--model", tiny_model_tok, "--out", tmp_path / "g", "--method", "gptq", "--nsamples", 2,
            "--seqlen", 32, "--no-progress")
    assert run(*args).exit_code == 130
    restore()
    state = partial_dir(tmp_path / "g") / STATE_DIR
    target = {"layer": layer_file(state, 0), "hidden": hidden_file(state, 1), "importance": importance_file(state, 0),
              "state.json": state / "state.json"}[artefact]
    data = bytearray(target.read_bytes())
    if artefact == "state.json":
        data = bytearray(data.decode().replace('"snr_db": ', '"snr_db": 9', 1).encode())
    else:
        data[-200:-100] = bytes(b ^ 0x55 for b in data[-200:-100])  # inside the data, the header intact
    target.write_bytes(bytes(data))
    monkeypatch.setattr(layerwise, "_quantize_layer", lambda *a, **k: pytest.fail("redid a layer before checking"))
    result = run(*args, "--resume")
    assert result.exit_code == 1 and "was changed after int4q wrote it" in result.stderr, result.output
    assert f"{target.name}" in result.stderr and "rerun without --resume" in result.stderr


def test_a_resume_refuses_files_int4q_did_not_leave_in_its_partial_folder(tiny_model_tok, tmp_path, monkeypatch):
    from quantizer.calibrate.state import STATE_DIR
    from quantizer.io.outdir import partial_dir

    restore = interrupt_gptq_at_second_layer(monkeypatch)
    args = ("quantize", "--model", tiny_model_tok, "--out", tmp_path / "g", "--method", "gptq", "--nsamples", 2,
            "--seqlen", 32, "--no-progress")
    assert run(*args).exit_code == 130
    restore()
    partial = partial_dir(tmp_path / "g")
    (partial / "planted.txt").symlink_to("/etc/hostname")
    result = run(*args, "--resume")
    assert result.exit_code == 1 and "planted.txt, which int4q did not leave there" in result.stderr
    assert (partial / "planted.txt").is_symlink() and not (tmp_path / "g").exists()
    (partial / "planted.txt").unlink()
    state = partial / STATE_DIR
    moved = tmp_path / "state-elsewhere"
    state.rename(moved)
    state.symlink_to(moved)
    result = run(*args, "--resume")
    assert result.exit_code == 1 and "is not a folder int4q made (a link or a file)" in result.stderr
    assert "--resume to continue" not in result.stderr and moved.is_dir()


def test_generate_and_bench_refuse_to_run_past_the_models_positions(tiny_model_tok):
    generated = CliRunner().invoke(main, ["generate", str(tiny_model_tok), "--prompt", "def f(x):",
                                          "--max-new-tokens", "600", "--no-compile"])
    assert generated.exit_code == 1 and "more than this model's 512 (max_position_embeddings)" in generated.output
    benched = CliRunner().invoke(main, ["bench", str(tiny_model_tok), "--prompt-tokens", "512", "--gen-tokens", "8",
                                        "--reps", "1", "--no-compile"])
    assert benched.exit_code == 1 and "--prompt-tokens 512 and --gen-tokens 8 make 520 positions" in benched.output


def test_the_cli_starts_without_importing_torch_or_transformers():
    code = "import sys, quantizer.cli.main; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_generate_saves_a_quick_start_once_and_the_next_run_prints_the_same_text(tiny_model_tok, tmp_path,
                                                                                    monkeypatch):
    from quantizer.runtime.kernels.w4a8 import has_w4a8
    from quantizer.runtime.kernels.w4a8_rows import has_w4a8_rows

    if not (has_w4a8() or has_w4a8_rows()):
        pytest.skip("this CPU has no int8 kernel: no native step, no snapshot")
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(tmp_path / "cache"))
    model = quantize_to(tiny_model_tok, tmp_path / "q", group_size=64)
    first = run("generate", model, "--prompt", "Hello there", "--max-new-tokens", 12)
    monkeypatch.setattr("quantizer.runtime.loader.load_model", lambda *a, **k: pytest.fail("the model was built"))
    second = run("generate", model, "--prompt", "Hello there", "--max-new-tokens", 12)
    assert first.exit_code == second.exit_code == 0, second.output
    assert "saved this model's decode plan for quick starts" in first.stderr
    assert "saved" not in second.stderr and second.stdout == first.stdout


@pytest.mark.parametrize("extra", [("--method", "gptq"), ("--method", "weighted", "--sym"), ()])
def test_refine_without_gptq_on_symmetric_grids_is_bad_usage_naming_what_to_add(tiny_model, tmp_path, extra):
    result = run("quantize", "--model", tiny_model, "--out", tmp_path / "q", "--refine", "--no-progress", *extra)
    assert_one_line_error(result, "--refine is for --method gptq on symmetric grids", code=2)
    assert not (tmp_path / "q").exists()


def test_an_endless_calibration_file_is_read_only_as_far_as_the_windows_need(tiny_model_tok, tmp_path):
    """/dev/zero as --calib under a 4 GB address-space limit: read to its budget, not forever."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-m", "quantizer", "quantize", "--model", str(tiny_model_tok), "--out",
                           str(tmp_path / "w"), "--method", "weighted", "--calib", "/dev/zero", "--nsamples", "2",
                           "--seqlen", "32", "--no-progress"], capture_output=True, text=True, timeout=600,
                          preexec_fn=limit)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "w" / "config.json").is_file()


def test_bench_decodes_after_a_context_of_the_given_depth_and_refuses_one_past_the_models_positions(
        tiny_model_tok, tmp_path):
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(main, ["bench", str(tiny_model_tok), "--prompt-tokens", "8", "--gen-tokens", "4",
                                     "--depth", "100", "--reps", "1", "--no-compile", "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert "tg4 at depth 100" in done.output and json.loads(out.read_text())["depth"] == 100
    too_deep = CliRunner().invoke(main, ["bench", str(tiny_model_tok), "--prompt-tokens", "8", "--gen-tokens", "8",
                                         "--depth", "510", "--no-compile"])
    assert too_deep.exit_code == 1 and "--depth 510 and --gen-tokens 8 make 518 positions" in too_deep.output
    negative = CliRunner().invoke(main, ["bench", str(tiny_model_tok), "--depth", "-1"])
    assert negative.exit_code == 2 and "--depth" in negative.output


def test_decode_speed_at_depth_times_only_the_steps_after_the_context():
    import torch

    from quantizer.runtime.bench import decode_tokens_per_s

    class Recorder:
        config = type("C", (), {"get_text_config": lambda self: type("T", (), {"vocab_size": 512})()})()

    calls = []

    class Decoder:
        def reset(self):
            calls.append("reset")

        def forward(self, ids):
            calls.append(ids.shape[1])
            return torch.zeros(1, 512)

    assert decode_tokens_per_s(Recorder(), 3, Decoder(), depth=50) > 0
    assert calls == ["reset", 50, 1, 1, 1]


def test_bench_over_an_int8_kv_cache_beside_the_bf16_one(tiny_q, tmp_path):
    from quantizer.runtime.kernels.kv_int8 import has_int8_cache
    from quantizer.runtime.kernels.w4a8 import has_w4a8

    if not (has_w4a8() and has_int8_cache()):
        pytest.skip("no int8 decode kernel or no int4q library here")
    result = run("bench", tiny_q, "--prompt-tokens", 0, "--gen-tokens", 3, "--depth", 40, "--reps", 1, "--no-compile",
                 "--decode", "int8", "--kv-cache", "int8", "--compare-kv", "--json", tmp_path / "b.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["kv_cache"] == "int8" and set(report["arms"]) == {"int4", "bf16kv"}
    assert all(arm["tg_median"] > 0 and arm["decode_path"] == "native" for arm in report["arms"].values())
    assert "bf16kv ratio: tg_median" in result.stdout


def test_bench_refuses_kv_options_that_cannot_hold(tiny_q):
    alone = run("bench", tiny_q, "--compare-kv")
    assert alone.exit_code == 2 and "Traceback" not in alone.output and "add --kv-cache int8" in alone.stderr
    assert_one_line_error(run("bench", tiny_q, "--kv-cache", "int8", "--decode", "exact", "--no-compile",
                              "--prompt-tokens", 8, "--gen-tokens", 2),
                          "--kv-cache int8: an int8 KV cache needs int8 decode activations", code=2)
    assert run("bench", tiny_q, "--kv-cache", "int4").exit_code == 2
