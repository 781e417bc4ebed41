"""Quantization methods: the grids (``grid``), round-to-nearest (``rtn``), GPTQ's solve (``gptq``)
and its method (``gptq_method``), activation-weighted rounding (``weighted``). Each method is
registered in :mod:`quantizer.schema.methods`; pure tensor code, no I/O."""

from ..schema.methods import METHODS, NAMES, UNCALIBRATED, MethodInfo, get_method

__all__ = ["METHODS", "NAMES", "UNCALIBRATED", "MethodInfo", "get_method"]
