"""int4q's version, written into the checkpoints it makes."""

__version__ = "0.1.0"
