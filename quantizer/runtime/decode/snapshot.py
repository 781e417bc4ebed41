"""A checkpoint's native decode step (:mod:`.native_step`) saved as data, so that later runs of
``generate`` start without building the model through transformers (which, with its imports,
takes most of a warm start): the plan's tensors, the embedding's and the head's, the rotary
tables, and the tokenizer (:mod:`.quick_tokenizer`).

A snapshot is written after a run that decoded natively, once per checkpoint (its files' names,
sizes, times, inodes and links, config.json's bytes and each shard's header), int4q runtime
source, torch version, machine and activation choice, in the int4q cache folder (private to this
user, as for the other artefacts): ``tensors.safetensors``, ``meta.json`` and ``tokenizer.json``,
each with its sha256 recorded (:mod:`quantizer.integrity`), no code. It is kept only where, read
back, it gives the native step's logits bit for bit; one whose files no longer match their
digests is removed and made again; a run then uses it for prompts the plan takes in one call
(``rows``) and gives what the full path gives, token for token. ``INT4Q_QUICK_START=0`` neither
writes nor reads snapshots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...integrity import changed_files, record_digest, temporary_sibling
from ...native.cache import UntrustedCache, machine_identity, trusted_cache_dir
from ..activations import current as current_activations
from ..kernels.attention import has_attend_one
from ..kernels.w4a8 import has_w4a8
from ..kernels.w4a8_rows import has_w4a8_rows
from ..nn.state import NotSaveable, module_state, rebuilt_module
from ..sources import runtime_source_digest
from .decoder import MIN_CACHE, FastDecoder, StepMismatch, unsupported_reason
from .generation import GenerationStats, detokenize, eos_token_ids, fast_greedy
from .native_step import (
    LAYER_TENSORS,
    NativeStep,
    NotCovered,
    PlanSpec,
    make_plan,
    native_step,
)
from .quick_tokenizer import QuickTokenizer, quick_record

log = logging.getLogger(__name__)

VERSION = 2
ENV = "INT4Q_QUICK_START"
POSITIONS = 32768
"""Rotary positions a snapshot keeps (fewer where the model has fewer, or a sliding window)."""


def quick_start_on() -> bool:
    return os.environ.get(ENV, "1") != "0"


def snapshot_dir(model_dir: Path) -> Path:
    """Where the snapshot of the checkpoint in ``model_dir`` is kept, keyed by what it depends on;
    UntrustedCache where the cache folder is not private."""
    root = Path(model_dir).resolve()
    files = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        st = entry.stat()
        files.append([entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                      os.readlink(entry.path) if entry.is_symlink() else "", _content_digest(Path(entry.path))])
    key = {"version": VERSION, "folder": str(root), "files": files, "sources": runtime_source_digest(),
           "torch": torch.__version__, "machine": machine_identity(), "activations": current_activations().encode()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return trusted_cache_dir("snapshots") / digest


def _content_digest(path: Path) -> str:
    """What of a checkpoint file the key reads: config.json whole, a safetensors shard's header
    (names, dtypes, shapes, offsets), nothing of other files (their times and inode stand for them)."""
    if path.name == "config.json" or path.suffix == ".safetensors":
        try:
            with open(path, "rb") as f:
                if path.name == "config.json":
                    return hashlib.sha256(f.read()).hexdigest()
                length = int.from_bytes(f.read(8), "little")
                return hashlib.sha256(f.read(min(length, 100 * 1000**2))).hexdigest()
        except OSError:
            return ""
    return ""


SNAPSHOT_FILES = ("tensors.safetensors", "meta.json", "tokenizer.json")


class DamagedSnapshot(ValueError):
    """A snapshot's files are not what int4q wrote (its recorded digests do not match)."""


@dataclass
class Snapshot:
    """A read snapshot: ``meta`` (meta.json), ``tensors`` by name, the quick tokenizer."""

    meta: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: QuickTokenizer

    @property
    def rows(self) -> int:
        return self.meta["plan"]["rows"]

    @property
    def positions(self) -> int:
        return self.meta["positions"]

    @property
    def eos(self) -> set[int]:
        return set(self.meta["eos"])

    def spec(self) -> PlanSpec:
        p, t = self.meta["plan"], self.tensors
        layers = [([t[f"layer.{i}.{j}"] for j in range(LAYER_TENSORS)], eps, groups)
                  for i, (eps, groups) in enumerate(p["layers"])]
        return PlanSpec(p["heads"], p["kv_heads"], p["head_dim"], p["scale"], t["norm"], p["eps"], layers, p["rows"])

    def decoder(self, max_len: int) -> "SnapshotDecoder":
        return SnapshotDecoder(self, max(max_len, MIN_CACHE))


class SnapshotDecoder:
    """A :class:`.decoder.FastDecoder`'s ``reset``/``forward`` over a snapshot, for up to ``max_len``
    positions; ``forward`` takes at most ``step.rows`` tokens at a time."""

    def __init__(self, snapshot: Snapshot, max_len: int):
        spec = snapshot.spec()
        kv_shape = (1, spec.kv_heads, max_len, spec.head_dim)
        self.keys = [torch.zeros(kv_shape, dtype=torch.bfloat16) for _ in spec.layers]
        self.values = [torch.zeros(kv_shape, dtype=torch.bfloat16) for _ in spec.layers]
        cos, sin = (snapshot.tensors[n][:, :max_len] for n in ("cos", "sin"))
        embed, head = (rebuilt_module(snapshot.meta[n], snapshot.tensors) for n in ("embed", "head"))
        self.step = NativeStep(spec, make_plan(spec, cos, sin, [[k, v] for k, v in zip(self.keys, self.values)]), embed, head)
        self.max_len, self.position = max_len, 0

    def reset(self) -> None:
        self.position = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.step(ids, self.position)
        self.position += ids.shape[1]
        return logits


def open_snapshot(model_dir: Path) -> Snapshot | None:
    """The checkpoint's snapshot, where one was saved for it as it is now and this process has the
    kernels its plan needs (each checked as on every load); else None."""
    if not quick_start_on():
        return None
    try:
        folder = snapshot_dir(model_dir)
        if not (folder / "meta.json").is_file():
            return None
        snapshot = _read(folder)
        return snapshot if _has_kernels(snapshot.spec()) else None
    except DamagedSnapshot as e:
        log.warning("%s; removed it, and this run makes it again", e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    except (UntrustedCache, OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
        log.info("no quick start for %s: %s", model_dir, e)
        return None


def _has_kernels(spec: PlanSpec) -> bool:
    loaded = {"w4a8_mm": has_w4a8, "w4a8_rows": has_w4a8_rows}
    return has_attend_one() and all(loaded[kernel]() for kernel in spec.kernels())


def _read(folder: Path) -> Snapshot:
    """The snapshot in ``folder``; DamagedSnapshot where a file is not the one int4q recorded."""
    changed = changed_files(folder / name for name in SNAPSHOT_FILES)
    if changed:
        raise DamagedSnapshot(f"the quick-start snapshot {folder} was changed after int4q wrote it "
                              f"({changed[0].name} does not match its recorded sha256)")
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("version") != VERSION:
        raise ValueError(f"snapshot version {meta.get('version')}, not {VERSION}")
    chat = tuple(meta["chat"]) if meta["chat"] else None
    tokenizer = QuickTokenizer.from_json((folder / "tokenizer.json").read_text(), chat)
    return Snapshot(meta, load_file(folder / "tensors.safetensors"), tokenizer)


def save_snapshot(model: torch.nn.Module, tokenizer, model_dir: Path) -> tuple[Path, int] | None:
    """Save the snapshot of ``model`` (loaded from ``model_dir``, with ``tokenizer``) where there is
    none yet and the native step runs it: (its folder, bytes) when written, else None (why: logged
    at INFO). Another run saving the same snapshot at once keeps the first one finished."""
    if not quick_start_on():
        return None
    try:
        folder = snapshot_dir(model_dir)
        if folder.exists():
            return None
        return folder, _write_checked(folder, *_parts(model, tokenizer))
    except (UntrustedCache, OSError, NotCovered, NotSaveable, StepMismatch, RuntimeError, ValueError, KeyError,
            SafetensorError) as e:  # the run's text is out: a snapshot that cannot be made is only left out
        log.info("no quick start saved for %s: %s", model_dir, e)
        return None


def _positions(config) -> int:
    """How many positions a snapshot serves: :data:`POSITIONS`, fewer where the model has fewer
    or attends through a sliding window."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    limits = (POSITIONS, getattr(config, "max_position_embeddings", None), window)
    return min(x for x in limits if isinstance(x, int) and x > 0)


def _parts(model: torch.nn.Module, tokenizer) -> tuple[dict, dict, str, FastDecoder]:
    """(meta, tensors, tokenizer JSON, a native decoder of ``model`` to check them against)."""
    positions = _positions(model.config.get_text_config())
    reason = unsupported_reason(model, positions)
    if reason:
        raise NotCovered(reason)
    decoder = FastDecoder(model, MIN_CACHE)
    step = native_step(decoder)
    if step is None:
        raise NotCovered("the native step does not run this model")
    record = quick_record(tokenizer)
    if record is None:
        raise NotCovered("its tokenizer needs transformers")
    spec = step.spec
    with torch.inference_mode():
        cos, sin = model.get_decoder().rotary_emb(torch.zeros(1, dtype=torch.bfloat16), torch.arange(positions)[None])
    if not (torch.equal(cos[:, :MIN_CACHE], decoder.cos) and torch.equal(sin[:, :MIN_CACHE], decoder.sin)):
        raise NotCovered("its rotary tables depend on their length")
    tensors = {"cos": cos, "sin": sin, "norm": spec.norm}
    tensors.update({f"layer.{i}.{j}": t for i, (ts, _, _) in enumerate(spec.layers) for j, t in enumerate(ts)})
    plan = {"heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "scale": spec.scale,
            "eps": spec.eps, "rows": spec.rows, "layers": [[eps, groups] for _, eps, groups in spec.layers]}
    meta = {"version": VERSION, "positions": positions, "eos": sorted(eos_token_ids(model, tokenizer)),
            "chat": list(record[1]) if record[1] else None, "plan": plan,
            "embed": module_state(decoder.embed, tensors, "embed"), "head": module_state(decoder.head, tensors, "head")}
    return meta, tensors, record[0], decoder


def _write_checked(folder: Path, meta: dict, tensors: dict, tokenizer_json: str, decoder: FastDecoder) -> int:
    """Write a snapshot beside ``folder``, check it read back against ``decoder`` and rename it into
    place; its size in bytes. StepMismatch where it differs; OSError where another run put one there
    first (or the disk refused)."""
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = temporary_sibling(folder)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(mode=0o700)
    try:
        save_file({name: t.contiguous().clone() for name, t in tensors.items()}, work / "tensors.safetensors")
        (work / "tokenizer.json").write_text(tokenizer_json)
        (work / "meta.json").write_text(json.dumps(meta))
        for name in SNAPSHOT_FILES:
            record_digest(work / name)
        _check(_read(work).decoder(MIN_CACHE), decoder)
        size = sum(f.stat().st_size for f in work.iterdir())
        work.rename(folder)
        return size
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check(quick: SnapshotDecoder, decoder: FastDecoder) -> None:
    """StepMismatch unless both give the same logits, bit for bit, for a prompt and a step."""
    logits = []
    for d in (quick, decoder):
        d.reset()
        logits.append(torch.cat([d.forward(torch.tensor([[1, 2, 3]])), d.forward(torch.tensor([[4]]))]))
    decoder.reset()
    if not torch.equal(*logits):
        raise StepMismatch("the snapshot read back differs from the native step")


def quick_text(model_dir: Path, prompt: str, max_new_tokens: int, chat: bool,
               stats: GenerationStats) -> Iterator[str] | None:
    """:func:`.generation.generate_text`'s pieces from the checkpoint's snapshot, where it has one
    that takes this prompt in one call; else None (the caller takes the full path)."""
    snapshot = open_snapshot(model_dir)
    if snapshot is None or (chat and snapshot.tokenizer.chat is None):
        return None
    ids = snapshot.tokenizer.encode(prompt, chat)
    if not 0 < len(ids) <= snapshot.rows or len(ids) + max_new_tokens > snapshot.positions:
        return None
    try:
        decoder = snapshot.decoder(len(ids) + max_new_tokens)
    except (RuntimeError, ValueError, KeyError) as e:
        log.info("no quick start for %s: %s", model_dir, e)
        return None
    stats.prompt_tokens = len(ids)
    tokens = fast_greedy(decoder, torch.tensor([ids]), max_new_tokens, snapshot.eos)
    return detokenize(snapshot.tokenizer, stats.count(tokens))
