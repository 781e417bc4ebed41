"""Grids recovered from weights that already sit on one, in a GGUF storage's own numbers. A weight
dequantized from Q4_0 or Q4_K blocks (a quantization-aware-trained checkpoint, a model rebuilt
from a GGUF) gets back the grids that hold it exactly, where a search that only minimises error
lands near them; one rounded to bf16 since gets grids near its own. Pure tensor functions.

A group is on a grid when its values are integer codes times a step plus an offset:

* symmetric (Q4_0, Q5_0, the GPTQ exports' symmetric grids, Q6_K's groups): ``u * step`` with
  ``u`` in ``-mid..qmax - mid``, the step an fp16 value (a K-quant's: a level of the super-block's
  fp16 unit);
* minimum (Q4_1, Q5_1; Q4_K, Q5_K): ``q * step + low`` with ``q`` in ``0..qmax``, the step and
  the lowest point fp16 values (a K-quant's: levels 0..63 of two fp16 units, the lowest point at
  most 0).

The step is tried as the group's range (or largest magnitude) over each of the ``SPANS`` largest
code spans, then as the smallest gap between its values (or a half or third of it). An exact grid
is checked by the values the GGUF decoder computes from it, so it holds the group bit for bit; a
near one is refitted by least squares and kept only where it beats the search's grid.
"""

from __future__ import annotations

import torch

from ..native.checked import CheckedKernel
from .candidates import ERROR, grid_scores
from .codes import code_range
from .recovered_units import NEAR, on_units

SPANS = 4
PROBE_ROWS = 8  # rows tried first: a weight whose probed groups mostly sit on no grid is not searched
PROBE_SHARE = 0.5
BATCHED_VALUES = 1 << 18
"""Without the native kernel, groups' values up to which every candidate grid is checked in one
torch pass (a probe's few rows); above it candidates go one at a time, on the groups still
unfound, to bound the memory."""


NEAR_SOURCE = 2.0**-7
"""How far (a fraction of its group's largest magnitude) a value may be from a grid and still be
taken as on it: a grid's values rounded to bf16 are within 2^-9 of them."""


def _symmetric_steps(g: torch.Tensor, bits: int, fp16: bool):
    """Candidate signed steps [N, G] (fp64) of symmetric groups g [N, G, group]: the largest
    magnitude over each span, each sign; rounded to fp16 values unless ``fp16`` is False (a
    K-quant's steps are levels of a unit, not fp16 values)."""
    mid, _ = code_range(bits)
    top = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1).to(torch.float64)
    for span in range(mid, mid - SPANS, -1):
        for sign in (1.0, -1.0):
            step = sign * top / span
            yield (step.to(torch.float16).to(torch.float64) if fp16 else step,)


def _minimum_grids(g: torch.Tensor, bits: int, fp16: bool):
    """Candidate (step, lowest point) [N, G] (fp64) of minimum groups g [N, G, group]: the range over
    each span, each code the group's lowest value may have; fp16 values unless ``fp16`` is False (a
    K-quant's lowest point is then found per super-block, see :func:`_minimum_units`)."""
    _, qmax = code_range(bits)
    lo, hi = g.amin(-1).to(torch.float64), g.amax(-1).to(torch.float64)
    for span in range(qmax, qmax - SPANS, -1):
        step = (hi - lo) / span
        if not fp16:
            yield step, lo
            continue
        step = step.to(torch.float16).to(torch.float64)
        for first in range(qmax - span + 1):
            yield step, (lo - first * step).to(torch.float16).to(torch.float64)


def _gap_grids(g: torch.Tensor, bits: int, symmetric: bool, fp16: bool):
    """Candidates for groups whose codes span fewer levels: the step is the smallest gap between a
    group's distinct values, or its half or third where no two codes are adjacent (each sign; each
    code of the lowest value)."""
    _, qmax = code_range(bits)
    ordered = g.sort(-1).values.to(torch.float64)  # fp32 values sort as their fp64 forms do
    gaps = ordered[..., 1:] - ordered[..., :-1]
    gap = torch.where(gaps > 0, gaps, torch.inf).amin(-1)
    gap = torch.where(torch.isinf(gap), 0.0, gap)
    lo = ordered[..., 0]
    for parts in (1, 2, 3):
        step = gap / parts
        step = step.to(torch.float16).to(torch.float64) if fp16 else step
        if symmetric:
            yield step, torch.zeros_like(step)
            yield -step, torch.zeros_like(step)
        elif not fp16:
            yield step, lo
        else:
            for first in range(qmax + 1):
                yield step, (lo - first * step).to(torch.float16).to(torch.float64)


def _fits(g: torch.Tensor, step: torch.Tensor, low: torch.Tensor, bits: int, symmetric: bool,
          slack: float = 0.0) -> torch.Tensor:
    """Whether each group of g [N, G, group] is its codes times ``step`` plus ``low`` (0 when
    symmetric) as GGUF's decoders compute it in fp32, codes in range -> [N, G]. With ``slack``:
    within that fraction of the group's largest magnitude (a step not yet snapped to its levels)."""
    mid, qmax = code_range(bits)
    s, m = step.unsqueeze(-1), low.unsqueeze(-1)
    q = torch.round((g.to(torch.float64) - m) / torch.where(s == 0, 1.0, s))
    lowest, highest = (-mid, qmax - mid) if symmetric else (0, qmax)
    if slack:  # never as loose as an eighth of a step, or the wrong span would fit too
        bound = torch.minimum(slack * g.abs().amax(-1, keepdim=True).to(torch.float64), s.abs() / 8)
        near = (q * s + m - g.to(torch.float64)).abs() <= bound
    elif symmetric:
        near = (q * s).to(torch.float32) == g
    else:
        near = q.to(torch.float32) * s.to(torch.float32) + m.to(torch.float32) == g
    return (near & (q >= lowest) & (q <= highest)).all(-1)


def _first_found(g: torch.Tensor, generators, bits: int, symmetric: bool,
                 slack: float) -> tuple[torch.Tensor, ...] | None:
    """Per group of g [M, group] the first candidate (step, low) [M] that fits (:func:`_fits`), each
    generator (a function of the groups still unfound) tried on those only: (step, low, found)
    [M], or None where none fits anywhere."""
    size = g.shape[0]
    step = torch.zeros(size, dtype=torch.float64, device=g.device)
    low, found = torch.zeros_like(step), torch.zeros(size, dtype=torch.bool, device=g.device)
    first_fit = FIRST_FIT() if g.device.type == "cpu" and g.dtype == torch.float32 else torch_first_fit
    for generate in generators:
        left = (~found).nonzero().squeeze(-1)
        if not left.numel():
            break
        sub = g[left]
        candidates = list(generate(sub))
        if candidates and (first_fit is not torch_first_fit or sub.numel() <= BATCHED_VALUES):  # all in one call
            steps, lows = (torch.stack(c).contiguous() for c in zip(*candidates))
            index = torch.empty(left.numel(), dtype=torch.int64, device=g.device)
            first_fit(sub.contiguous(), steps, lows, code_range(bits)[1], symmetric, slack, index)
            hit = (index >= 0).nonzero().squeeze(-1)
            step[left[hit]], low[left[hit]], found[left[hit]] = steps[index[hit], hit], lows[index[hit], hit], True
            continue
        alive = torch.arange(left.numel(), device=g.device)  # the positions in sub still unfound
        for cand_step, cand_low in candidates:
            if not alive.numel():
                break
            ok = _fits(sub[alive], cand_step[alive], cand_low[alive], bits, symmetric, slack)
            hit = alive[ok]
            step[left[hit]], low[left[hit]], found[left[hit]] = cand_step[hit], cand_low[hit], True
            alive = alive[~ok]
    return (step, low, found) if bool(found.any()) else None


def torch_first_fit(x: torch.Tensor, steps: torch.Tensor, lows: torch.Tensor, qmax: int, symmetric: bool,
                    slack: float, out: torch.Tensor) -> None:
    """The index of the first candidate of ``steps`` and ``lows`` [C, M] (fp64) that holds each group
    of x [M, group] (fp32) by :func:`_fits`, or -1 where none does, written into ``out`` [M] int64."""
    ok = _fits(x, steps, lows, (qmax + 1).bit_length() - 1, symmetric, slack)
    out.copy_(torch.where(ok.any(0), ok.to(torch.uint8).argmax(0), -1))  # argmax: the first of equal values


def _fit_probe(kernel) -> list[torch.Tensor]:
    """The indices ``kernel`` writes for seeded groups of 16 and 32, half on a grid (at a candidate
    chosen per group, the others a step or a low off it), exact and with slack, symmetric and not,
    4- and 6-bit, some values rounded to bf16 and some groups all zero."""
    gen = torch.Generator().manual_seed(3)
    written = []
    for size, bits, symmetric, slack in ((32, 4, False, 0.0), (16, 6, True, 0.0), (32, 4, False, NEAR_SOURCE),
                                        (16, 6, True, 2.0**-20), (32, 5, True, NEAR_SOURCE)):
        mid, qmax = code_range(bits)
        m, count = 48, 5
        step = (torch.rand(m, generator=gen) * 0.01 + 1e-3).to(torch.float16).to(torch.float64)
        low = torch.zeros(m, dtype=torch.float64) if symmetric else -(torch.rand(m, generator=gen) * 0.05).to(
            torch.float16).to(torch.float64)
        codes = torch.randint(0, qmax + 1, (m, size), generator=gen).to(torch.float64) - (mid if symmetric else 0)
        x = (codes * step[:, None]).to(torch.float32) + low[:, None].to(torch.float32)
        x[m // 2:] += torch.randn(m - m // 2, size, generator=gen) * 1e-3
        x[::7] = x[::7].to(torch.bfloat16).to(torch.float32)
        x[5] = 0.0
        at = torch.randint(0, count, (m,), generator=gen)
        off = torch.arange(count)[:, None] != at[None, :]
        steps = step.expand(count, m) * torch.where(off, 1.0 + 0.01 * torch.arange(count)[:, None], 1.0)
        lows = low.expand(count, m) + torch.where(off & (torch.arange(count)[:, None] % 2 == 0), 1e-4, 0.0)
        out = torch.full((m,), 99, dtype=torch.int64)
        kernel(x.contiguous(), steps.contiguous(), lows.contiguous(), qmax, symmetric, slack, out)
        written.append(out)
    return written


FIRST_FIT = CheckedKernel(torch_first_fit, lambda library: library.first_fit, _fit_probe, "grid recovery")


def recovered_grids(g: torch.Tensor, symmetric: bool, bits: int, superblock: int | None = None,
                    near: float = 0.0):
    """Grids that hold groups g [N, G, group] (fp32) exactly, as int4q's (scale, zero) [N, G] fp64
    (zero = lowest point + mid * scale; 0 when symmetric) and found [N, G] bool; None where no group
    is on a grid. With ``superblock`` (groups per K-quant super-block) the steps, and the minimums,
    are levels of one fp16 unit per super-block (found to within :data:`NEAR`, then snapped to
    them and checked exactly); a super-block is found only where all its groups are. With ``near``,
    grids each value is within that fraction of its group's largest magnitude of (a grid rounded
    to bf16, say), refitted by least squares and not checked here (see :func:`with_recovered`)."""
    mid, _ = code_range(bits)
    n, groups, size = g.shape
    fp16, slack = superblock is None, (near if superblock is None else max(near, NEAR))
    if symmetric:
        def spans(sub):
            return ((s, torch.zeros_like(s)) for (s,) in _symmetric_steps(sub, bits, fp16))
    else:
        def spans(sub):
            return _minimum_grids(sub, bits, fp16)
    generators = [spans, lambda sub: _gap_grids(sub, bits, symmetric, fp16)]
    hit = _first_found(g.reshape(-1, size), generators, bits, symmetric, slack)
    if hit is None:
        return None
    step, low, found = (t.reshape(n, groups) for t in hit)
    if near:
        step, low = _refit(g, step, low, symmetric, fp16)
    if superblock is not None:
        step, low, found = on_units(g, step, low, found, symmetric, bits, superblock, max(near, NEAR))
        if not near:  # a near grid is kept only where it beats the search (with_recovered)
            found &= _fits(g, step, low, bits, symmetric)
        found = found.reshape(found.shape[0], -1, superblock).all(-1).repeat_interleave(superblock, dim=1)
    zero = torch.zeros_like(step) if symmetric else low + mid * step
    return step, zero, found


def _refit(g: torch.Tensor, step: torch.Tensor, low: torch.Tensor, symmetric: bool, fp16: bool):
    """Each group's least-squares (step, low) [N, G] for the codes its near grid gives (the near
    grid's own step carries its extreme values' rounding; the fit averages over the group)."""
    x = g.to(torch.float64)
    s = step.unsqueeze(-1)
    q = torch.round((x - low.unsqueeze(-1)) / torch.where(s == 0, 1.0, s))
    if symmetric:
        fitted = (q * x).sum(-1) / (q * q).sum(-1).clamp(min=1)
        fitted, new_low = torch.where(step == 0, step, fitted), low
    else:
        count, sq, sqq, sx, sqx = x.shape[-1], q.sum(-1), (q * q).sum(-1), x.sum(-1), (q * x).sum(-1)
        det = count * sqq - sq * sq
        safe = torch.where(det == 0, 1.0, det)
        fitted = torch.where(det == 0, step, (count * sqx - sq * sx) / safe)
        new_low = torch.where(det == 0, low, (sqq * sx - sq * sqx) / safe)
    if fp16:
        fitted, new_low = (t.to(torch.float16).to(torch.float64) for t in (fitted, new_low))
    return fitted, new_low


def with_recovered(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, storage, symmetric: bool,
                   weights: torch.Tensor | None = None):
    """(scale, zero) [N, G] as chosen for groups g [N, G, group] (fp32), with each group (each
    super-block, for a K-quant storage) that a recovered grid holds exactly taking that grid, and
    each that lies within :data:`NEAR_SOURCE` of a grid taking it where its error (weighted by
    ``weights`` [G, group]) is lower than the chosen grid's. Only GGUF's and the GPTQ exports' fp16
    storages are searched (asymmetric: those that store a minimum), and each pass only where most
    groups of the first rows are on (near) a grid."""
    if storage.scale_dtype != torch.float16 or (not symmetric and storage.zero != "min"):
        return scale, zero
    superblock = storage.superblock if storage.couples(g.shape[1]) else None
    if storage.superblock and superblock is None:
        return scale, zero
    dtype = storage.exact_dtype
    scale, zero = scale.to(dtype), zero.to(dtype)

    def search(groups, near):
        found = recovered_grids(groups, symmetric, storage.bits, superblock, near)
        if found is not None and not storage.signed_scale:
            found = (*found[:2], found[2] & (found[0] >= 0))
        return found

    taken = torch.zeros(scale.shape, dtype=torch.bool, device=scale.device)
    for near in (0.0, NEAR_SOURCE):  # exact grids first; then near ones where they beat the search
        probe = search(g[:PROBE_ROWS], near)
        if probe is None or float(probe[2].float().mean()) < PROBE_SHARE or bool(taken.all()):
            continue
        step, rec_zero, found = search(g, near)
        step, rec_zero = step.to(dtype), rec_zero.to(dtype)
        found &= ~taken
        if near:
            found &= _lower_error(g, (step, rec_zero), (scale, zero), weights, storage.bits, superblock)
        scale, zero = torch.where(found, step, scale), torch.where(found, rec_zero, zero)
        taken |= found
    return scale, zero


def _lower_error(g, candidate, chosen, weights, bits: int, superblock: int | None) -> torch.Tensor:
    """Where the candidate grids' squared error (per super-block, where they share units) is lower
    than the chosen grids' -> [N, G] bool."""
    errors = [grid_scores(g, s, z, weights, bits)[..., ERROR] for s, z in (candidate, chosen)]
    if superblock:
        errors = [e.reshape(e.shape[0], -1, superblock).sum(-1).repeat_interleave(superblock, dim=1) for e in errors]
    return errors[0] < errors[1]
