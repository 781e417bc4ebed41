"""int4q: 4-bit group-wise checkpoints for CPU inference (the cpu_int4 format).

Importing this package imports neither torch nor transformers. ``quantizer.runtime`` loads and
runs checkpoints; ``import quantizer.integrations.transformers`` registers cpu_int4 with
transformers' ``from_pretrained``.
"""

import os

# MKL's default code paths may round differently from run to run (buffer alignment), and GPTQ
# amplifies one-ulp differences; AUTO,STRICT keeps results bit-reproducible at near full speed
# (COMPATIBLE is ~6x slower). MKL reads this when it initialises, so it is set before torch is.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# ...and with a fixed thread count: MKL otherwise uses fewer threads when the machine is busy,
# which changes how its sums are split.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

__version__ = "0.1.0"

