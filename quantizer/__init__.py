"""int4q: 4-bit group-wise checkpoints for CPU inference (the cpu_int4 format), GPTQ/AWQ exports
and GGUF files for llama.cpp.

The Python API is three calls (:mod:`quantizer.api`), imported on first use, so that importing
this package imports neither torch nor transformers::

    import quantizer
    report = quantizer.quantize("models/smollm2-135m-bf16", "models/smollm2-int4", group_size=64)
    assert quantizer.verify("models/smollm2-int4", reference="models/smollm2-135m-bf16").passed
    model = quantizer.load("models/smollm2-int4")

``import quantizer.integrations.transformers`` registers cpu_int4 with transformers'
``from_pretrained``.
"""

import importlib
import os

# MKL's default code paths may round differently from run to run (buffer alignment), and GPTQ
# amplifies one-ulp differences; AUTO,STRICT keeps results bit-reproducible at near full speed
# (COMPATIBLE is ~6x slower). MKL reads this when it initialises, so it is set before torch is.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# ...and with a fixed thread count: MKL otherwise uses fewer threads when the machine is busy,
# which changes how its sums are split.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

from .version import __version__

_API = {"quantize": ".api", "verify": ".api", "load": ".api", "VerifyReport": ".api",
        "QuantizeReport": ".quantization.report"}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name], __name__), name)
