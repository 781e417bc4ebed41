"""The quantized modules' buffers, moved into one region of transparent huge pages where Linux offers
them (:func:`...memory.huge_pages_offered`); ``INT4Q_HUGE_PAGES=0`` leaves them where they are.

Decode reads every weight once a token, from memory. On 4 KiB pages that stream misses the TLB every
4 KiB and the hardware prefetchers stop at every page; on 2 MiB pages the int8 kernels read
Qwen2.5-Coder-1.5B's weights markedly faster (docs/runtime.md, "Huge pages"). Each tensor keeps its
values, shape and strides; tensors that shared memory share it in the region too, and a tensor two
modules held (a tied table and head) stays one tensor. Storages are copied one at a time and the old
memory freed as each goes, so the peak is the region plus the largest storage.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from ...memory import HUGE_PAGE, advise_huge_pages, huge_pages_offered

ENV = "INT4Q_HUGE_PAGES"
ALIGN = 64
"""Bytes each storage's start in the region is a multiple of: a cache line, and every dtype's size."""


def huge_pages_wanted() -> bool:
    """Whether the loader moves weights onto huge pages: offered by the kernel, not switched off by
    ``INT4Q_HUGE_PAGES=0``."""
    return os.environ.get(ENV, "1") != "0" and huge_pages_offered()


def onto_huge_pages(modules: Iterable[torch.nn.Module]) -> int:
    """Move the CPU buffers of ``modules`` into one region advised for huge pages; returns the bytes
    moved, 0 where :func:`huge_pages_wanted` is false or the kernel refuses the advice."""
    if not huge_pages_wanted():
        return 0
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    sizes: dict[int, int] = {}
    for module in modules:
        for name, tensor in module.named_buffers(recurse=False):
            if tensor is None or not tensor.numel() or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            owners.setdefault(storage.data_ptr(), []).append((module, name))
            sizes[storage.data_ptr()] = storage.nbytes()
    spans = {ptr: -(-size // ALIGN) * ALIGN for ptr, size in sizes.items()}
    total = sum(spans.values())
    if not total:
        return 0
    region = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -region.data_ptr() % HUGE_PAGE
    if not advise_huge_pages(region.data_ptr() + start, total):
        return 0
    at = start
    for ptr, span in spans.items():
        _move(owners.pop(ptr), region, at)
        at += span
    return total


def _move(owners: list[tuple[torch.nn.Module, str]], region: torch.Tensor, at: int) -> None:
    """Copy the storage the buffers ``owners`` (module, name) share to byte ``at`` of ``region`` and
    make each buffer the same view of the copy; buffers that were one tensor stay one tensor."""
    module, name = owners[0]
    source = torch.empty(0, dtype=torch.uint8).set_(getattr(module, name).untyped_storage())
    region[at : at + source.numel()].copy_(source)
    views: dict[int, torch.Tensor] = {}
    for module, name in owners:
        old = getattr(module, name)
        if id(old) not in views:
            views[id(old)] = torch.empty(0, dtype=old.dtype).set_(
                region.untyped_storage(), at // old.element_size() + old.storage_offset(), old.size(), old.stride())
        setattr(module, name, views[id(old)])
