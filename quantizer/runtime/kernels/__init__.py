"""int4q's native kernels: one library of PyTorch operators (``csrc/``), built when int4q is
installed; ``library`` loads it, ``dequant`` and ``gemv`` wrap its kernels with their checks and
torch fallbacks, ``build`` is how it is built."""
