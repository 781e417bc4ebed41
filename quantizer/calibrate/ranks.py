"""The processes of one calibrated run: under ``torchrun`` every rank runs the same command, each
on its own share of the calibration windows, and they meet in a few collectives (a sum of each
step's statistics, a broadcast of each solved weight). A single process is a world of one, where
every collective is a no-op, so the single-process path does exactly what it did before.

Gloo carries CPU runs and NCCL runs where every rank has a GPU (``--device cuda``). A rank that
dies breaks its peers' next collective; they raise :class:`RankLost`, one line naming it."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
from dataclasses import dataclass

import torch

from ..errors import Int4qError

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankLost(Int4qError):
    """A peer rank stopped: the run cannot go on without its windows."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: its rank, the world size and the device it computes on."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """Rank 0 reads the calibration text, writes the output and reports progress."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shares(self, count: int) -> list[int]:
        """How many of ``count`` windows each rank takes: contiguous, sizes differing by at most one."""
        base, extra = divmod(count, self.world_size)
        return [base + (r < extra) for r in range(self.world_size)]

    def share(self, count: int) -> slice:
        """This rank's windows among ``count``."""
        sizes = self.shares(count)
        start = sum(sizes[:self.rank])
        return slice(start, start + sizes[self.rank])

    def owner_of(self, sizes: list[int]) -> list[int]:
        """The rank that solves each of several jobs of the given sizes: largest first, each to
        the rank with the least work so far (ties to the lowest rank)."""
        load = [0] * self.world_size
        owners = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            owners[i] = min(range(self.world_size), key=lambda r: load[r])
            load[owners[i]] += sizes[i]
        return owners

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.distributed:
            on_device = tensor.to(self._comm_device())
            self._collective(torch.distributed.all_reduce, on_device)
            if on_device is not tensor:
                tensor.copy_(on_device)
        return tensor

    def gather_value(self, value: float) -> list[float]:
        """Every rank's ``value``, by rank (a collective: it also waits for every rank)."""
        values = torch.zeros(self.world_size, dtype=torch.float64)
        values[self.rank] = value
        return self.sum_(values).tolist()

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` from rank ``src`` on every rank (picklable; keep it small)."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        self._collective(torch.distributed.broadcast_object_list, box, src=src,
                         device=torch.device(self._comm_device()))
        return box[0]

    def broadcast_dataclass(self, value, src: int):
        """A dataclass of tensors (a quantized weight) from rank ``src``: its layout and its other
        fields (bit widths) go as an object, then each tensor by itself."""
        if not self.distributed:
            return value
        mine = self.rank == src
        if mine:
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            layout = (type(value), {n: (v.shape, v.dtype) if isinstance(v, torch.Tensor) else v
                                    for n, v in fields.items()}, [n for n, v in fields.items()
                                                                  if isinstance(v, torch.Tensor)])
        kind, out, tensor_names = self.broadcast_object(layout if mine else None, src=src)
        for name in tensor_names:
            shape, dtype = out[name]
            t = fields[name].to(self._comm_device()) if mine else torch.empty(
                shape, dtype=dtype, device=self._comm_device())
            self._collective(torch.distributed.broadcast, t, src=src)
            out[name] = t.to(self.device)
        return kind(**out)

    def barrier(self) -> None:
        if self.distributed:
            self._collective(torch.distributed.barrier)

    def _comm_device(self) -> str:
        return "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"

    def _collective(self, op, *args, **kwargs):
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:  # gloo and NCCL report a lost peer as a RuntimeError
            raise RankLost(f"rank {self.rank} of {self.world_size}: {self._lost_peer()} stopped "
                           f"({_first_sentence(str(e))})") from None

    def _lost_peer(self) -> str:
        others = [r for r in range(self.world_size) if r != self.rank]
        return f"rank {others[0]}" if len(others) == 1 else "another rank"


def _first_sentence(message: str) -> str:
    """The gist of a backend error, without its source location: "Read error ...: Connection reset by peer"."""
    line = message.splitlines()[0] if message else "no message"
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". ")[0][:160]


SINGLE = Ranks()


def in_launcher() -> bool:
    """True when ``torchrun`` (or anything that sets its environment) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join(device: str = "cpu", timeout_minutes: float = 60.0) -> Ranks:
    """This process's :class:`Ranks`: from torchrun's environment (rendezvous as it gives it), else a
    world of one. Starts the process group: NCCL for ``cuda``, gloo for ``cpu``."""
    if device == "cuda" and not torch.cuda.is_available():
        raise Int4qError("--device cuda: this process sees no CUDA device; use --device cpu")
    if not in_launcher():
        return Ranks(device=device)
    missing = [k for k in ENV_KEYS if k not in os.environ]
    if missing:
        raise Int4qError(f"WORLD_SIZE is set but {', '.join(missing)} is not; start the run with torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo",
                                             timeout=datetime.timedelta(minutes=timeout_minutes))
    return Ranks(rank, world, device)


def leave(ranks: Ranks) -> None:
    """End the process group (after the last collective)."""
    if ranks.distributed and torch.distributed.is_initialized():
        # The run's objects in reference cycles can still hold the group's work; freed only at
        # interpreter exit, after the group, gloo's threads abort the process (SIGABRT).
        gc.collect()
        torch.distributed.destroy_process_group()
