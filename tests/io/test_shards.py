"""Streamed shard writing: planned headers, any arrival order, completeness and read-back checks."""

import json

import pytest
import torch
from safetensors.torch import load_file

from quantizer.errors import InputError
from quantizer.io.checkpoint import CheckpointReader
from quantizer.io.shards import ShardWriter, TensorSpec, parse_size, write_safetensors


def test_written_safetensors_load_back_identically(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.uint8),
        "c": torch.randn(2, 2, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors)
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def specs_of(tensors):
    return [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]


def test_shard_writer_caps_shards_and_writes_an_index(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i), dtype=torch.float32) for i in range(5)}  # 400 B each
    writer = ShardWriter(tmp_path, specs_of(tensors), max_shard_bytes=1000)
    for k in reversed(list(tensors)):  # any arrival order: each tensor has its planned place
        writer.add(k, tensors[k])
    paths = writer.finish()
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t4"] == "model-00003-of-00003.safetensors"
    assert index["metadata"]["total_size"] == 2000
    reader = CheckpointReader(tmp_path)
    for k, v in tensors.items():
        assert torch.equal(reader.get(k), v)
        assert torch.equal(load_file(tmp_path / reader.infos[k].file.name)[k], v)


def test_single_shard_is_named_model_safetensors(tmp_path):
    writer = ShardWriter(tmp_path, [TensorSpec("x", torch.float32, (4,))], max_shard_bytes=10**9)
    writer.add("x", torch.ones(4))
    assert [p.name for p in writer.finish()] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_shard_writer_refuses_what_was_not_planned_and_notices_what_never_came(tmp_path):
    writer = ShardWriter(tmp_path, [TensorSpec("a", torch.bfloat16, (2, 3)), TensorSpec("b", torch.uint8, (5,))], 10**9)
    with pytest.raises(ValueError, match="planned torch.bfloat16"):
        writer.add("a", torch.zeros(3, 2, dtype=torch.bfloat16))
    writer.add("a", torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="never written, e.g. b"):
        writer.finish()


def test_shard_writer_checks_the_headers_it_wrote(tmp_path):
    writer = ShardWriter(tmp_path, [TensorSpec("a", torch.float32, (4,))], 10**9)
    writer.add("a", torch.ones(4))
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[data.index(b'"F32"') + 2] = ord("6")  # F32 -> F62: the header on disk is not the plan
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="differs from what was planned"):
        writer.finish()


@pytest.mark.parametrize("text,expected", [("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("64KiB", 65536), ("1000", 1000)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(InputError):
        parse_size("lots")
