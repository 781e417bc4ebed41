"""The runtime's modules: the int4 linear and lookup (``int4``), the 8-bit ones (``int8``), fused
projections (``fusion``), and swapping them in and out of a model (``swap``)."""
