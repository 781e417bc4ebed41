"""int4q's outputs on the bundled model stay byte for byte what they were when these digests were
recorded (before the package's floors were rearranged): cpu_int4, the GPTQ v1 export, a Q4_K_M
GGUF and a weighted cpu_int4 run. A change that means to alter an output records new digests
with the reason in its commit; any other change leaves them as they are."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantizer.cli import main

DIGESTS = json.loads((Path(__file__).parent / "data" / "bundled_outputs.json").read_text())
RUNS = {
    "cpu": ["--group-size", "64"],
    "gptqv1": ["--format", "gptq", "--group-size", "64"],
    "q4km.gguf": ["--format", "gguf", "--gguf-type", "q4_k_m"],
    "weighted": ["--method", "weighted", "--nsamples", "4", "--seqlen", "64", "--group-size", "64"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_bundled_model_outputs_are_the_recorded_bytes(smollm2_bf16, tmp_path, name):
    out = tmp_path / name
    done = CliRunner().invoke(main, ["quantize", "--model", str(smollm2_bf16), "--out", str(out), "--no-progress",
                                     *RUNS[name]])
    assert done.exit_code == 0, done.output
    files = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
    got = {str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in files if p.name != "quantization_report.json"}
    assert got == {k: v for k, v in DIGESTS.items() if k.split("/")[0] == name}
