"""``int4q verify``: the structural check (``structure``), each tensor's round trip and kernel
layout (``tensors``), end-to-end fidelity against the source (``fidelity``), and the run that
orders them and gives the verdict (``run``)."""
