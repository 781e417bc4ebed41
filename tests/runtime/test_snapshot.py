"""A saved native step (decode/snapshot.py) starts generate without transformers and gives the
full path's text token for token; it is made only where it reads back bit for bit, and never
serves a checkpoint that changed since."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import quantize_to
from test_native_step import save_tiny

from quantizer.io.tokenizer import load_tokenizer
from quantizer.runtime import load_model
from quantizer.runtime.activations import EXACT, Activations
from quantizer.runtime.decode import snapshot
from quantizer.runtime.decode.generation import GenerationStats, generate_text
from quantizer.runtime.decode.quick_tokenizer import quick_record
from quantizer.runtime.kernels.w4a8 import has_w4a8
from quantizer.runtime.kernels.w4a8_rows import has_w4a8_rows

INT8 = Activations("int8", "int8")
CHAT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "The quick brown fox"

pytestmark = pytest.mark.skipif(not (has_w4a8() or has_w4a8_rows()), reason="this CPU has no int8 kernel: no native step")


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A quantized tiny Llama with a chat template, a cache of its own, int8 activations."""
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("INT4Q_ACTIVATIONS", INT8.encode())
    path = quantize_to(save_tiny("llama", tmp_path / "bf16"), tmp_path / "int4", group_size=64)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(path)
    return path


def full_text(path, prompt: str, chat: bool = False, tokens: int = 16) -> str:
    model, tokenizer = load_model(path), load_tokenizer(path)
    return "".join(generate_text(model, tokenizer, prompt, tokens, chat=chat, compile=False))


def saved(path):
    return snapshot.save_snapshot(load_model(path), load_tokenizer(path), path)


@pytest.mark.parametrize("chat", [False, True])
def test_the_quick_start_gives_the_full_paths_text(checkpoint, chat):
    folder, size = saved(checkpoint)
    assert folder.is_dir() and size > 0
    stats = GenerationStats()
    quick = snapshot.quick_text(checkpoint, PROMPT, 16, chat, stats)
    assert quick is not None
    assert "".join(quick) == full_text(checkpoint, PROMPT, chat)
    assert stats.new_tokens == 16 and stats.prompt_tokens > 0


def test_a_snapshot_of_row_major_linears_gives_the_full_paths_text(checkpoint, monkeypatch):
    import quantizer.runtime.nn.int4 as int4_modules

    monkeypatch.setattr(int4_modules, "kernel_layout_matches", lambda n: False)  # as on AVX2
    monkeypatch.setattr(int4_modules, "_warned_layout", True)
    saved(checkpoint)
    monkeypatch.setattr(snapshot, "has_w4a8", lambda: False)  # ... which has no kernel-layout int8 kernel
    assert snapshot.open_snapshot(checkpoint).meta["plan"]["rows"] == 64
    quick = snapshot.quick_text(checkpoint, PROMPT, 16, False, GenerationStats())
    assert "".join(quick) == full_text(checkpoint, PROMPT)


def test_a_snapshot_is_saved_once(checkpoint):
    assert saved(checkpoint) is not None
    assert saved(checkpoint) is None


def test_a_changed_checkpoint_is_not_served_from_an_old_snapshot(checkpoint):
    saved(checkpoint)
    assert snapshot.open_snapshot(checkpoint) is not None
    config = checkpoint / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1))
    assert snapshot.open_snapshot(checkpoint) is None


def test_a_prompt_longer_than_one_call_takes_the_full_path(checkpoint):
    saved(checkpoint)
    long_prompt = "x" * (snapshot.open_snapshot(checkpoint).rows + 1)  # one byte, one token
    assert snapshot.quick_text(checkpoint, long_prompt, 4, False, GenerationStats()) is None
    assert snapshot.quick_text(checkpoint, long_prompt[:-1], 4, False, GenerationStats()) is not None


@pytest.mark.parametrize("damage", ["tensors.safetensors", "meta.json", "a tensor"])
def test_a_damaged_snapshot_is_passed_over_for_the_full_path(checkpoint, damage):
    folder, _ = saved(checkpoint)
    if damage == "a tensor":
        meta = json.loads((folder / "meta.json").read_text())
        meta["plan"]["layers"].append(meta["plan"]["layers"][0])  # one layer more than the tensors hold
        (folder / "meta.json").write_text(json.dumps(meta))
    else:
        (folder / damage).write_bytes(b"\x10" + bytes(7) + b"{not what was written")
    assert snapshot.quick_text(checkpoint, PROMPT, 4, False, GenerationStats()) is None


@pytest.mark.parametrize("name", snapshot.SNAPSHOT_FILES)
def test_flipped_bytes_in_a_snapshot_are_found_and_the_snapshot_made_again(checkpoint, name, caplog):
    """Bytes flipped inside a file (it still parses) are caught by its recorded sha256: the full
    path runs, with one warning, and the next save writes a fresh snapshot that serves again."""
    folder, _ = saved(checkpoint)
    target = folder / name
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle] = data[middle] ^ 0x01
    target.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert snapshot.quick_text(checkpoint, PROMPT, 4, False, GenerationStats()) is None
    assert any("was changed after int4q wrote it" in r.getMessage() for r in caplog.records)
    assert not folder.exists()
    assert saved(checkpoint) is not None
    assert "".join(snapshot.quick_text(checkpoint, PROMPT, 8, False, GenerationStats())) == \
        full_text(checkpoint, PROMPT, tokens=8)


def test_weights_rewritten_in_place_with_their_old_times_are_not_served_the_old_snapshot(checkpoint):
    """cp -p or rsync -a over a checkpoint keeps names, sizes and times; the key also reads each
    file's inode and change time (which no copy sets) and each shard's header."""
    saved(checkpoint)
    before = snapshot.snapshot_dir(checkpoint)
    shard = checkpoint / "model.safetensors"
    times = (shard.stat().st_atime_ns, shard.stat().st_mtime_ns)
    with open(shard, "r+b") as f:  # the same inode, the same size
        f.seek(-64, os.SEEK_END)
        tail = f.read(64)
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    os.utime(shard, ns=times)
    assert snapshot.snapshot_dir(checkpoint) != before
    assert snapshot.open_snapshot(checkpoint) is None


def test_a_snapshot_may_not_set_a_modules_methods_or_internals():
    from quantizer.runtime.nn.state import module_state, rebuilt_module

    tensors = {}
    state = module_state(torch.nn.Linear(4, 4), tensors, "x")
    assert rebuilt_module(state, tensors).in_features == 4
    for key in ("forward", "_parameters", "__class__", "weight"):
        planted = {**state, "settings": {**state["settings"], key: 1}}
        with pytest.raises(ValueError, match=f"sets '{key}', which is not one of its settings"):
            rebuilt_module(planted, tensors)


def test_a_snapshot_that_reads_back_otherwise_is_not_kept(checkpoint, monkeypatch):
    real = snapshot._read

    def damaged(folder):
        read = real(folder)
        read.tensors["norm"] = read.tensors["norm"] * 2
        return read

    monkeypatch.setattr(snapshot, "_read", damaged)
    assert saved(checkpoint) is None
    assert not list((checkpoint.parent / "cache" / "snapshots").iterdir())  # nothing kept, nothing half-written


def test_a_plan_that_cannot_be_read_back_leaves_no_snapshot_and_no_traceback(checkpoint, monkeypatch):
    monkeypatch.setattr(snapshot, "make_plan", lambda *a: (_ for _ in ()).throw(RuntimeError("DecodePlan: refused")))
    assert saved(checkpoint) is None
    assert not list((checkpoint.parent / "cache" / "snapshots").iterdir())


def test_quick_start_off_neither_writes_nor_reads(checkpoint, monkeypatch):
    saved(checkpoint)
    monkeypatch.setenv(snapshot.ENV, "0")
    assert snapshot.open_snapshot(checkpoint) is None
    monkeypatch.delenv(snapshot.ENV)
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(checkpoint.parent / "other-cache"))
    monkeypatch.setenv(snapshot.ENV, "0")
    assert saved(checkpoint) is None and not (checkpoint.parent / "other-cache" / "snapshots").exists()


def test_a_model_the_native_step_does_not_run_gets_no_snapshot(checkpoint, monkeypatch):
    monkeypatch.setenv("INT4Q_ACTIVATIONS", EXACT.encode())
    assert saved(checkpoint) is None


def test_a_chat_template_that_reads_the_clock_has_no_quick_chat(checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    assert quick_record(tokenizer)[1] is not None
    tokenizer.chat_template = "{{ strftime_now('%d %b %Y') }}" + CHAT
    backend_json, chat = quick_record(tokenizer)
    assert chat is None and backend_json


def test_a_tokenizer_whose_decoding_transformers_cleans_up_has_no_quick_form(checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    assert quick_record(tokenizer) is not None
    tokenizer.clean_up_tokenization_spaces = True  # transformers 5 cleans a BPE tokenizer's text only if forced
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert quick_record(tokenizer) is None


def test_the_quick_start_imports_neither_transformers_nor_dynamo(checkpoint):
    saved(checkpoint)
    code = ("import sys; from pathlib import Path; from quantizer.runtime.decode import snapshot; "
            "from quantizer.runtime.decode.generation import GenerationStats; "
            f"text = ''.join(snapshot.quick_text(Path({str(checkpoint)!r}), 'Hi', 4, False, GenerationStats())); "
            "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr
