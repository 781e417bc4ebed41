import json

import pytest
import torch
from safetensors.torch import save_file

from quantizer.errors import InputError
from quantizer.io.checkpoint import CheckpointReader


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


def _with_header(tmp_path, header_text: str, data: bytes = b"\0" * 64):
    """A model folder whose only shard has this raw header text and data section."""
    (tmp_path / "config.json").write_text("{}")
    raw = header_text.encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return tmp_path


ENTRY = '"dtype": "F32", "shape": [4], "data_offsets": [%d, %d]'
MALFORMED = {
    "overlapping offsets": ('{"a": {%s}, "b": {%s}}' % (ENTRY % (0, 16), ENTRY % (8, 24)), "overlap"),
    "negative offsets": ('{"a": {%s}}' % (ENTRY % (-16, 0)), "corrupt header entry for a"),
    "a repeated key": ('{"a": {%s}, "a": {%s}}' % (ENTRY % (0, 16), ENTRY % (16, 32)), "'a' appears twice"),
    "a JSON list": ('[1, 2]', "a JSON list, not an object"),
    "a string entry": ('{"a": "x"}', "corrupt header entry for a"),
    "no data_offsets": ('{"a": {"dtype": "F32", "shape": [4]}}', "corrupt header entry for a"),
    "string offsets": ('{"a": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}}', "corrupt header entry"),
    "50,000-deep nesting": ('{"a": ' + "[" * 50_000 + "]" * 50_000 + "}", "corrupt safetensors header"),
    "offsets past the file": ('{"a": {%s}}' % (ENTRY % (0, 4096)), "truncated"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_header_is_one_clear_error_as_the_safetensors_library_refuses_it(tmp_path, case):
    from safetensors import safe_open

    header, message = MALFORMED[case]
    d = _with_header(tmp_path, header)
    with pytest.raises(InputError, match=message) as caught:
        CheckpointReader(d)
    assert "\n" not in str(caught.value)
    with pytest.raises(Exception):  # the library refuses it too, in its own words
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
