"""The core quantize call, without Click: it reports progress and notes, and leaves a finished
folder whose report counts the bytes it wrote."""

import json

import pytest

from quantizer.errors import InputError
from quantizer.quantization.planning import QuantizeOptions
from quantizer.quantization.request import QuantizeRequest
from quantizer.quantization.run import Progress, quantize_checkpoint


class Recorded(Progress):
    def __init__(self):
        self.total, self.done, self.notes = None, 0, []

    def start(self, total_bytes):
        self.total = total_bytes

    def advance(self, nbytes):
        self.done += nbytes

    def note(self, message):
        self.notes.append(message)


def test_a_streamed_run_reports_every_source_byte_and_counts_what_it_wrote(tiny_model, tmp_path):
    progress = Recorded()
    report = quantize_checkpoint(QuantizeRequest(str(tiny_model), tmp_path / "q", QuantizeOptions(group_size=64)),
                                 progress)
    assert progress.total == progress.done == report.summary.source_bytes and progress.notes == []
    saved = json.loads((tmp_path / "q" / "quantization_report.json").read_text())
    assert saved["summary"]["tensors_quantized"] == report.summary.tensors_quantized == 15
    written = sum(e["bytes"] for e in saved["tensors"].values())
    assert saved["summary"]["bits_per_weight"] == round(8 * written / saved["summary"]["quantized_params"], 4) == 4.5


def test_the_gptq_layout_notes_the_kept_table(tiny_model, tmp_path):
    progress = Recorded()
    quantize_checkpoint(QuantizeRequest(str(tiny_model), tmp_path / "g", QuantizeOptions(checkpoint_format="gptq")),
                        progress)
    assert progress.notes == ["the gptq format has no quantized vocabulary table: model.embed_tokens stays in bf16"]


def test_a_source_inside_the_output_is_refused_before_any_work(tiny_model, tmp_path):
    with pytest.raises(InputError):
        quantize_checkpoint(QuantizeRequest(str(tiny_model), tiny_model.parent, QuantizeOptions(), overwrite=True))
    assert (tiny_model / "config.json").is_file()
