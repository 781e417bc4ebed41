"""Writing a GGUF file takes less memory than its largest weight, whatever the model's size: the
converter's index tensors take none, and int4q's blocks reach the file one weight at a time, as
it is written (the run's peak is then its quantization's, one tensor at a time)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TOKENIZER_FILES, save_tiny_llama

pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
# in a fresh process: MiB resident as the file's assembly starts, and the peak while it runs
# (writing 5 to clear_refs resets VmHWM to the current resident set)
CHILD = """
import json, sys
import quantizer.formats.gguf.write as write
from quantizer.api import quantize
from quantizer.memory import peak_rss_mb, proc_status_mb
assemble, seen = write.write_from_blocks, []
def measured(*args, **kwargs):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = proc_status_mb("VmRSS")
    names = assemble(*args, **kwargs)
    seen.append((start, peak_rss_mb()))
    return names
write.write_from_blocks = measured
quantize(sys.argv[1], sys.argv[2], format="gguf", gguf_type=sys.argv[3])
print(json.dumps(seen[0]))
"""
HIDDEN, VOCAB = 2048, 49152
LARGEST_MB = HIDDEN * VOCAB * 2 / 2**20  # the table and the head: 192 MiB each in bf16


@pytest.fixture(scope="module")
def wide_tables(smollm2_bf16, tmp_path_factory):
    """A one-layer Llama whose untied table and head are nearly all of its 420 MB."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("wide") / "bf16", tie=False, vocab_size=VOCAB,
                             hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=1, num_attention_heads=16,
                             num_key_value_heads=4, shard=None)
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((smollm2_bf16 / name).read_bytes())
    return folder


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's clear_refs")
@pytest.mark.parametrize("gguf_type", ["q4_0", "q4_k_m"])
def test_writing_the_file_takes_less_memory_than_its_largest_bf16_tensor_once_more(wide_tables, tmp_path, gguf_type):
    done = subprocess.run([sys.executable, "-c", CHILD, str(wide_tables), str(tmp_path / "m.gguf"), gguf_type],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    start, peak = json.loads(done.stdout.strip().splitlines()[-1])
    assert peak - start < LARGEST_MB, (start, peak)
