"""The resumable state of a layer-by-layer calibrated run, kept in ``<partial out>/.gptq-state``:
each finished layer's tensors, the hidden states after the last finished layer, and a
``state.json`` that says how far the run got under which fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch

from .errors import InputError
from .shards import write_safetensors

log = logging.getLogger(__name__)
STATE_DIR = ".gptq-state"


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


def hidden_file(state_dir: Path, layers_done: int) -> Path:
    """The hidden states after the first ``layers_done`` layers: named by that count, so a state
    can only ever be paired with the activations it was saved with."""
    return state_dir / f"hidden-{layers_done:05d}.safetensors"


def layer_file(state_dir: Path, index: int) -> Path:
    return state_dir / f"layer-{index:05d}.safetensors"


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def load_state(state_dir: Path, fp: str, resume: bool) -> dict:
    """The saved progress of an earlier run with the same fingerprint (with ``resume``), else a fresh start."""
    fresh = {"layers_done": 0, "tensors": {}}
    path = state_dir / "state.json"
    if not resume or not path.is_file():
        if resume:
            log.warning("nothing to resume; starting from the first layer")
        shutil.rmtree(state_dir, ignore_errors=True)
        state_dir.mkdir(parents=True)
        return fresh
    restart = "rerun without --resume to start over"
    try:
        state = json.loads(path.read_text())
        done = int(state["layers_done"])
    except (ValueError, KeyError, TypeError):
        raise InputError(f"{path} is corrupt; {restart}") from None
    if state.get("fingerprint") != fp:
        raise InputError(f"the interrupted run was made with different inputs or settings; {restart}")
    needed = [layer_file(state_dir, i) for i in range(done)] + ([hidden_file(state_dir, done)] if done else [])
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise InputError(f"the saved state in {state_dir} is incomplete (no {missing[0]}); {restart}")
    return state


def save_state(state_dir: Path, fp: str, layers_done: int, per_tensor: dict, as_tuple: bool,
               layer_tensors: dict[str, torch.Tensor], hidden: torch.Tensor) -> None:
    """Persist one finished layer: its tensors and the hidden states after it (each under a name
    of its own), then the state that says it is done, each written to a temporary name and
    renamed; only then the previous layer's hidden states go."""
    for path, tensors in ((layer_file(state_dir, layers_done - 1), layer_tensors),
                          (hidden_file(state_dir, layers_done), {"hidden": hidden})):
        tmp = path.with_name(path.name + ".tmp")
        write_safetensors(tmp, tensors)
        tmp.replace(path)
    tmp = state_dir / "state.json.tmp"
    tmp.write_text(json.dumps({"fingerprint": fp, "layers_done": layers_done, "tensors": per_tensor,
                               "as_tuple": as_tuple}))
    tmp.replace(state_dir / "state.json")
    hidden_file(state_dir, layers_done - 1).unlink(missing_ok=True)
