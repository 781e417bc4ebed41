"""int4q: 4-bit group-wise checkpoints for CPU inference (the cpu_int4 format)."""

__version__ = "0.1.0"
