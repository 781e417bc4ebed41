"""The grid searches' candidate loops as one native pass per group (``int4q_native::shrink_search``,
``stretch_search`` and ``signed_search``): each group's values stay in cache while every candidate
grid is scored, where the torch loops pass over the whole chunk once per candidate. The torch loops
are the reference (:func:`.shrink_search.torch_shrink_search`,
:func:`.llama_searches.torch_stretch_search`, :func:`.llama_searches.torch_signed_search`); a kernel
is used only after it writes their bits on the seeded probes below
(:class:`..native.checked.CheckedKernel`). Pure tensor functions.
"""

from __future__ import annotations

from typing import Callable

import torch

from .candidates import LANES
from .codes import code_range


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernels take groups x [..., B]: on the CPU, B a multiple of the scoring lanes."""
    return x.device.type == "cpu" and x.shape[-1] % LANES == 0


def takes(g: torch.Tensor, weights: torch.Tensor, storage, symmetric: bool) -> bool:
    """Whether :func:`shrink_search` gives the shrink loop's result for groups g and weights (both
    fp32) on ``storage``: grids stored in fp32 (the groups of a K-quant super-block before their
    levels), asymmetric or symmetric with a signed scale."""
    fp32 = storage.scale_dtype == torch.float32 and storage.zero == "float" and not storage.superblock
    inputs = g.dtype == torch.float32 and weights.dtype == torch.float32
    return runs_on(g) and inputs and fp32 and not storage.codebook and (not symmetric or storage.signed_scale)


def shrink_search(kernel: Callable, g: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  fixed: tuple[torch.Tensor, torch.Tensor], symmetric: bool, bits: int,
                  shrinks: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The shrink loop's fp32 (scale, zero) [N, G] for groups g [N, G, B] with weights [G, B], ranges
    lo, hi [N, G] and ``fixed`` (sum(w) [G], sum(w g) [N, G]), by ``kernel``."""
    n, groups, _ = g.shape
    scale, zero = torch.empty(n, groups), torch.empty(n, groups)
    sw, swx = (t.to(torch.float32).contiguous() for t in fixed)
    kernel(g.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous(), lo.contiguous(),
           hi.contiguous(), sw, swx, torch.tensor(shrinks, dtype=torch.float32), code_range(bits)[1], symmetric,
           scale, zero)
    return scale, zero


def stretch_search(kernel: Callable, x: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, span: torch.Tensor,
                   sums: tuple[torch.Tensor, ...], steps: list, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stretch loop's (step, zero) [N, G] for groups x [N, G, B] with their own weights
    [N, G, B], lowest points and nonzero spans [N, G], ``sums`` (of w, w x, w x x) [N, G] and the
    step counts ``steps`` (the min/max grid's first), by ``kernel``."""
    n, groups, size = x.shape
    step, zero = torch.empty(n * groups), torch.empty(n * groups)
    flat = [t.reshape(-1).to(torch.float32).contiguous() for t in (low, span, *sums)]
    kernel(x.reshape(1, n * groups, size).contiguous(), weights.reshape(1, n * groups, size).contiguous(), *flat,
           torch.tensor([float(s) for s in steps], dtype=torch.float32), code_range(bits)[1], step, zero)
    return step.reshape(n, groups), zero.reshape(n, groups)


def signed_search(kernel: Callable, x: torch.Tensor, weights: torch.Tensor, top: torch.Tensor, steps: list,
                  bits: int) -> torch.Tensor:
    """The signed loop's step [N, G] for groups x [N, G, B] with their own weights [N, G, B], values
    of largest magnitude ``top`` [N, G] (nonzero) and the step counts ``steps`` (the plain one
    first), by ``kernel``."""
    n, groups, size = x.shape
    scale = torch.empty(n * groups)
    kernel(x.reshape(1, n * groups, size).contiguous(), weights.reshape(1, n * groups, size).contiguous(),
           top.reshape(-1).to(torch.float32).contiguous(), torch.tensor([float(s) for s in steps], dtype=torch.float32),
           code_range(bits)[1], scale)
    return scale.reshape(n, groups)


def shrink_operator(library) -> Callable:
    return library.shrink_search


def stretch_operator(library) -> Callable:
    return library.stretch_search


def signed_operator(library) -> Callable:
    return library.signed_search


def _probe_groups(gen: torch.Generator, rows: int, groups: int, size: int) -> torch.Tensor:
    """Seeded groups [rows, groups, size]: normal values, a flat group, an all-zero group and one
    with a single outlier, so that ties, zero steps and clamped codes are on the probe."""
    x = torch.randn(rows, groups, size, generator=gen) * 0.05
    x[0, 0] = 0.01
    x[1, 1] = 0.0
    x[2, 0, 3] = 1.5
    return x


def shrink_probe(kernel: Callable) -> list[torch.Tensor]:
    """The scales and zeros ``kernel`` writes for seeded groups of 8, 16 and 32, 4- to 6-bit grids,
    asymmetric and signed symmetric, weights with zeros."""
    gen = torch.Generator().manual_seed(0)
    written = []
    for size, bits, symmetric in ((8, 4, False), (16, 6, True), (32, 4, False), (32, 5, False), (16, 4, True)):
        x = _probe_groups(gen, 9, 4, size)
        weights = torch.rand(4, size, generator=gen) * (torch.rand(4, size, generator=gen) > 0.1)
        lo, hi = x.amin(-1), x.amax(-1)
        fixed = weights.sum(-1), (weights * x).sum(-1)
        written.extend(shrink_search(kernel, x, weights, lo, hi, fixed, symmetric, bits,
                                     [1.0, 0.95, 0.9, 0.8, 1.02]))
    return written


def stretch_probe(kernel: Callable) -> list[torch.Tensor]:
    """The steps and zeros ``kernel`` writes for seeded groups of 16 and 32, 4- and 5-bit grids,
    ggml's both stretch ranges, per-element weights with zeros."""
    gen = torch.Generator().manual_seed(1)
    written = []
    for size, bits, first, delta in ((32, 4, -1.0, 0.1), (32, 5, -0.5, 0.1), (16, 4, -0.9, 0.05)):
        x = _probe_groups(gen, 9, 4, size)
        weights = torch.rand(x.shape, generator=gen) * (torch.rand(x.shape, generator=gen) > 0.1)
        low = x.amin(-1).clamp(max=0.0)
        span = x.amax(-1) - low
        span = torch.where(span == 0, 1.0, span)
        wx = weights * x
        nmax = 2**bits - 1
        steps = [float(nmax)] + [first + delta * i + nmax for i in range(12)]
        written.extend(stretch_search(kernel, x, weights, low, span, (weights.sum(-1), wx.sum(-1), (wx * x).sum(-1)),
                                      steps, bits))
    return written


def signed_probe(kernel: Callable) -> list[torch.Tensor]:
    """The steps ``kernel`` writes for seeded groups of 16 and 32, 6- and 4-bit grids, weights
    x^2 and per-element weights with zeros."""
    gen = torch.Generator().manual_seed(2)
    written = []
    for size, bits in ((16, 6), (32, 4)):
        x = _probe_groups(gen, 9, 4, size)
        for weights in (x * x, torch.rand(x.shape, generator=gen) * (torch.rand(x.shape, generator=gen) > 0.1)):
            top = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
            top = torch.where(top == 0, 1.0, top)
            nmax = 2 ** (bits - 1)
            written.append(signed_search(kernel, x, weights, top, [nmax] + [nmax + 0.1 * i for i in range(-9, 10) if i],
                                         bits))
    return written
