"""The resumable state of a layer-by-layer calibrated run, kept in ``<partial out>/.calibration-state``:
each finished layer's tensors, the hidden states after the last finished layer, and a
``state.json`` that says how far the run got under which fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import InputError
from ..integrity import changed_files, digest_path, matches_digest, record_digest
from ..io.shards import write_safetensors
from .ranks import SINGLE, Ranks

log = logging.getLogger(__name__)


class BadResumeState(InputError):
    """The saved state cannot be resumed from: resuming again would fail the same way."""
STATE_DIR = ".calibration-state"


def fingerprint(*parts, files: list[Path] = (), tensors: tuple[torch.Tensor, ...] = ()) -> str:
    """Identifies a run's inputs and settings (JSON-able ``parts``, the files' sizes and mtimes,
    the tensors' bytes, the torch version); a partial run resumes only under the same one."""
    h = hashlib.sha256()
    for part in parts:
        h.update(json.dumps(part, sort_keys=True).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for t in tensors:
        h.update(t.numpy().tobytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def hidden_file(state_dir: Path, layers_done: int, ranks: Ranks = SINGLE) -> Path:
    """This rank's hidden states after the first ``layers_done`` layers: named by that count (and
    in a distributed run by the rank and world size), so a state can only ever be paired with the
    activations it was saved with."""
    suffix = f"-rank{ranks.rank}of{ranks.world_size}" if ranks.distributed else ""
    return state_dir / f"hidden-{layers_done:05d}{suffix}.safetensors"


def layer_file(state_dir: Path, index: int) -> Path:
    return state_dir / f"layer-{index:05d}.safetensors"


def importance_file(state_dir: Path, index: int) -> Path:
    """Layer ``index``'s input statistics: each quantized linear's column mean squares."""
    return state_dir / f"importance-{index:05d}.safetensors"


ROWS_SUFFIX = "#rows"


def load_importance(state_dir: Path, layers: int) -> dict[str, tuple[torch.Tensor, int]]:
    """Every saved layer's statistics: module -> (column mean squares [K] fp32, input rows)."""
    found = {}
    for i in range(layers):
        tensors = read_safetensors(importance_file(state_dir, i))
        found.update({name: (t, int(tensors[name + ROWS_SUFFIX].item()))
                      for name, t in tensors.items() if not name.endswith(ROWS_SUFFIX)})
    return found


def _importance_tensors(importance: dict[str, tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    tensors = {name: mean.to(torch.float32).contiguous() for name, (mean, _) in importance.items()}
    return {**tensors, **{name + ROWS_SUFFIX: torch.tensor([rows]) for name, (_, rows) in importance.items()}}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def load_state(state_dir: Path, fp: str, resume: bool, ranks: Ranks = SINGLE) -> dict:
    """The saved progress of an earlier run with the same fingerprint (with ``resume``), else a
    fresh start. Rank 0 only; each rank then reads its own hidden states with :func:`load_hidden`."""
    fresh = {"layers_done": 0, "tensors": {}}
    path = state_dir / "state.json"
    if state_dir.is_symlink() or (state_dir.exists() and not state_dir.is_dir()):
        raise BadResumeState(f"{state_dir} is not a folder int4q made (a link or a file); remove it yourself, then "
                             "run again without --resume")
    if not resume or not path.is_file():
        if resume:
            log.warning("nothing to resume; starting from the first layer")
        shutil.rmtree(state_dir, ignore_errors=True)
        state_dir.mkdir(parents=True)
        return fresh
    restart = "rerun without --resume to start over"
    if not matches_digest(path):
        raise BadResumeState(f"{path} was changed after int4q wrote it (it does not match its recorded sha256, or "
                             f"an older int4q recorded none); {restart}")
    try:
        state = json.loads(path.read_text())
        done = int(state["layers_done"])
    except (ValueError, KeyError, TypeError):
        raise BadResumeState(f"{path} is corrupt; {restart}") from None
    if state.get("fingerprint") != fp:
        raise BadResumeState(f"the interrupted run was made with different inputs or settings; {restart}")
    layers = [f(state_dir, i) for i in range(done) for f in (layer_file, importance_file)]
    needed = layers + ([hidden_file(state_dir, done, ranks)] if done else [])
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise BadResumeState(f"the saved state in {state_dir} is incomplete (no {missing[0]}); {restart}")
    # every file now, not when the output is written after the remaining layers; the hidden states
    # are checked where each rank reads its own (load_hidden), before any layer runs
    changed = changed_files(layers)
    if changed:
        raise BadResumeState(f"the saved state in {state_dir} was changed after int4q wrote it ({changed[0].name} "
                             f"does not match its recorded sha256); {restart}")
    return state


def load_hidden(state_dir: Path, layers_done: int, ranks: Ranks) -> torch.Tensor:
    """This rank's saved hidden states; every rank raises the same error when any rank lacks its own."""
    path = hidden_file(state_dir, layers_done, ranks)
    intact = matches_digest(path)
    missing = ranks.sum_(torch.tensor([0.0 if intact else 1.0]))
    if missing.item():
        mine = "intact" if intact else "missing, or changed after int4q wrote it"
        raise BadResumeState(f"the saved state in {state_dir} is incomplete or was changed after int4q wrote it: "
                             f"{int(missing.item())} rank(s) lack their hidden states after layer {layers_done} or "
                             f"hold changed ones (this rank's {path.name}: {mine}); resume with the same processes on "
                             "the same machines, or rerun without --resume to start over")
    return read_safetensors(path)["hidden"]


def save_layer(state_dir: Path, fp: str, layers_done: int, per_tensor: dict, as_tuple: bool,
               layer_tensors: dict[str, torch.Tensor] | None, hidden: torch.Tensor, ranks: Ranks = SINGLE,
               importance: dict[str, tuple[torch.Tensor, int]] | None = None) -> None:
    """Persist one finished layer: rank 0 its tensors and its linears' input statistics
    (``importance``: module -> (column mean squares, rows)), every rank its own hidden states
    (each file under a name of its own, written to a temporary name and renamed); once all have,
    rank 0 writes the state that says the layer is done; only then the previous hidden states go."""
    files = [(hidden_file(state_dir, layers_done, ranks), {"hidden": hidden})]
    if ranks.is_main:
        files[:0] = [(layer_file(state_dir, layers_done - 1), layer_tensors),
                     (importance_file(state_dir, layers_done - 1), _importance_tensors(importance or {}))]
    for path, tensors in files:
        _write_atomically(path, tensors)
    ranks.barrier()
    if ranks.is_main:
        tmp = state_dir / "state.json.tmp"
        tmp.write_text(json.dumps({"fingerprint": fp, "layers_done": layers_done, "tensors": per_tensor,
                                   "as_tuple": as_tuple}))
        tmp.replace(state_dir / "state.json")
        record_digest(state_dir / "state.json")
    ranks.barrier()
    _remove(hidden_file(state_dir, layers_done - 1, ranks))


class LayerSaves:
    """:func:`save_layer` calls, one at a time and in order, written behind the caller's next
    layer where ``ranks`` is one process (across processes each is a collective, made in the
    caller's thread). The caller must not change what it passed until the next :meth:`save`
    or :meth:`wait`. A context manager: leaving waits for the last save."""

    def __init__(self, ranks: Ranks = SINGLE):
        self._pool = ThreadPoolExecutor(1, "int4q-save") if not ranks.distributed else None
        self._pending: Future | None = None

    def save(self, *args, **kwargs) -> None:
        """:func:`save_layer` (args, kwargs), once the previous save is written."""
        self.wait()
        if self._pool is None:
            save_layer(*args, **kwargs)
        else:
            self._pending = self._pool.submit(save_layer, *args, **kwargs)

    def wait(self) -> None:
        """Block until the save in flight is written; raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> "LayerSaves":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``path`` written whole under a temporary name, then renamed, then its sha256 recorded."""
    tmp = path.with_name(path.name + ".tmp")
    write_safetensors(tmp, tensors)
    tmp.replace(path)
    record_digest(path)


def remove_hidden(state_dir: Path, layers_done: int, ranks: Ranks = SINGLE) -> None:
    """This rank's hidden states after ``layers_done`` layers, and their recorded digest, removed."""
    _remove(hidden_file(state_dir, layers_done, ranks))


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    digest_path(path).unlink(missing_ok=True)
