"""--target-bpw: a GGUF whose quantized tensors take the bits asked for (within 1 %), each tensor a
type llama.cpp reads, recorded in the file's quantization_config; verify passes it, llama.cpp runs
it (where its tools are built), and a target the types cannot reach is one line with nothing
written."""

import json
import shutil

import pytest
from conftest import LLAMA_COMPLETION, assert_llama_cpp_generates
from test_gguf import assert_verify_passes, quantize, run
from test_gguf_iq4 import save_grouped_queries

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def grouped_queries(smollm2_bf16, tmp_path_factory):
    return save_grouped_queries(tmp_path_factory.mktemp("gguf-target") / "bf16", smollm2_bf16)


def quantized_bits_per_weight(path) -> float:
    """Bits per weight over the file's quantized (block-typed) tensors."""
    reader = gguf.GGUFReader(path)
    quantized = [t for t in reader.tensors if t.tensor_type.name not in ("F32", "F16", "BF16")]
    return 8 * sum(int(t.n_bytes) for t in quantized) / sum(int(t.n_elements) for t in quantized)


def size_target(path) -> dict:
    config = json.loads(gguf.GGUFReader(path).fields["int4q.quantization_config"].contents())
    return config["calibration"]["size_target"]


def test_sized_files_take_the_bits_asked_for_and_more_bits_give_less_error(grouped_queries, tmp_path):
    errors = []
    for target in (4.5, 4.8):
        out = quantize(grouped_queries, tmp_path / f"{target}.gguf", "--target-bpw", str(target))
        got = quantized_bits_per_weight(out)
        assert target * 0.99 <= got <= target
        record = size_target(out)
        assert record["target_bpw"] == target and abs(record["planned_bpw"] - got) < 1e-3
        assert sum(record["types"].values()) == 8 * 7 + 1 and len(record["types"]) > 1  # the layers' and the table
        errors.append(record["relative_error"])
    assert errors[1] < errors[0]
    assert_verify_passes(out, grouped_queries)
    if shutil.which(LLAMA_COMPLETION):
        assert_llama_cpp_generates(out)


@pytest.mark.parametrize("extra, message", [
    (("--format", "gguf", "--target-bpw", "3"), "--target-bpw 3 is outside what this model's types can reach"),
    (("--format", "gguf", "--target-bpw", "5", "--gguf-type", "q4_k_m"),
     "--target-bpw chooses every module's type; drop --gguf-type"),
    (("--format", "gguf", "--target-bpw", "5", "--override", "down_proj=8"),
     "--target-bpw chooses every module's type; drop --override"),
    (("--target-bpw", "5"), "--target-bpw is for --format gguf"),
])
def test_a_target_the_file_cannot_take_is_one_line_and_writes_nothing(grouped_queries, tmp_path, extra,
                                                                      message):
    out = tmp_path / ("m.gguf" if "gguf" in extra else "m")
    result = run("quantize", "--model", grouped_queries, "--out", out, "--no-progress", *extra)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []
