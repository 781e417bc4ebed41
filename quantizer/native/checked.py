"""int4q's native kernels for the methods' inner loops, each with its torch loop as the reference:
a kernel is used only after it reproduces that loop bit for bit on a seeded probe, decided once
per process; otherwise (or where the library cannot load) the torch loop runs, after one warning."""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


class CheckedKernel:
    """The native form of ``reference`` (a function writing its results into its tensor arguments):
    ``operator(library)`` gives it from the loaded library; ``probe(kernel)`` runs a kernel on a
    seeded problem and returns the tensors it wrote. ``what`` names the loop in the warnings."""

    def __init__(self, reference: Callable, operator: Callable, probe: Callable, what: str):
        self.reference, self.operator, self.probe, self.what = reference, operator, probe, what
        self._chosen: list = []

    def __call__(self) -> Callable:
        """The kernel this process uses: the native one where it passed, else the reference."""
        if not self._chosen:
            self._chosen.append(self.checked(self.native()) or self.reference)
        return self._chosen[0]

    def native(self) -> Callable | None:
        """The native kernel, unchecked, or None where the library does not load (one warning)."""
        from .library import load_unless_off, ops

        library = load_unless_off(ops, f"{self.what} in torch", "Reinstall int4q")
        return None if library is None else self.operator(library)

    def checked(self, kernel: Callable | None) -> Callable | None:
        """``kernel`` where it gives the reference's results to the bit on the probe, else None after
        one warning."""
        if kernel is None:
            return None
        if all(torch.equal(a, b) for a, b in zip(self.probe(kernel), self.probe(self.reference))):
            return kernel
        log.warning("int4q's native %s gives other results than torch here and is not used; it runs in torch "
                    "(slower)", self.what)
        return None
