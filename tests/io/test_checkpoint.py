import json

import pytest
import torch
from safetensors.torch import save_file

from quantizer.io.checkpoint import CheckpointReader, copy_aux_files
from quantizer.errors import InputError


def test_reader_reads_what_safetensors_wrote(tmp_path):
    t = {"w": torch.randn(16, 8).to(torch.bfloat16), "n": torch.randn(8).to(torch.float16)}
    save_file(t, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    reader = CheckpointReader(tmp_path)
    assert set(reader.infos) == {"w", "n"}
    assert reader.infos["w"].shape == (16, 8)
    for k in t:
        assert torch.equal(reader.get(k), t[k])


def _model_dir(tmp_path, tensors=None):
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors or {"w": torch.randn(64, 64)}, tmp_path / "model.safetensors")
    return tmp_path


def test_truncated_shard_is_reported(tmp_path):
    d = _model_dir(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(InputError, match="truncated"):
        CheckpointReader(d)


def test_corrupt_header_is_reported(tmp_path):
    d = _model_dir(tmp_path)
    data = bytearray((d / "model.safetensors").read_bytes())
    data[10:20] = b"\xff" * 10
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(InputError, match="corrupt"):
        CheckpointReader(d)


def test_index_naming_a_missing_shard_is_reported(tmp_path):
    d = _model_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(InputError, match="missing shard.*gone.safetensors"):
        CheckpointReader(d)


def test_pickle_only_checkpoint_is_refused_without_unpickling(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(InputError, match="never unpickles"):
        CheckpointReader(tmp_path)


def test_aux_files_are_copied_but_not_weights_or_model_card(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json", "config.json", "README.md",
                 "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", ".int4q-bundled"):
        (src / name).write_text("x")
    assert copy_aux_files(src, dst) == ["chat_template.jinja", "generation_config.json", "tokenizer.json"]
