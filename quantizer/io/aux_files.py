"""The files beside the weights that a checkpoint needs (tokenizer, special tokens, chat template,
generation config, license), copied into an output. Nothing else is copied: not the source's
model card, scripts (``*.py`` beside an ``auto_map``), notes or anything a link brings in from
outside the model folder."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

AUX_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "generation_config.json", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "preprocessor_config.json", "processor_config.json", "NOTICE",
})
AUX_SUFFIXES = (".model", ".tiktoken", ".jinja")
LICENSE_PREFIXES = ("LICENSE", "LICENCE")


def is_aux_file(name: str) -> bool:
    """Whether a file of this name is one a checkpoint needs beside its weights."""
    return name in AUX_NAMES or name.endswith(AUX_SUFFIXES) or name.upper().startswith(LICENSE_PREFIXES)


def allowed_roots(model_dir: Path) -> list[Path]:
    """Where a link in ``model_dir`` may point: the folder itself, and for a Hugging Face cache
    snapshot (``<repo>/snapshots/<rev>``) the repo's ``blobs`` folder that its links name."""
    root = Path(model_dir).resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def leaves(path: Path, roots: list[Path]) -> bool:
    """Whether ``path`` (a link, or a path through one) resolves outside every one of ``roots``."""
    target = Path(path).resolve()
    return not any(target == r or r in target.parents for r in roots)


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy the aux files of ``src`` into ``dst`` as plain files. A link that resolves outside the
    model folder is skipped with a warning, never followed. Returns the names copied."""
    roots = allowed_roots(src)
    copied = []
    for p in sorted(Path(src).iterdir()):
        if not is_aux_file(p.name) or not p.is_file():
            continue
        if p.is_symlink() and leaves(p, roots):
            log.warning("not copied: %s is a link to %s, outside the model folder", p.name, p.resolve())
            continue
        shutil.copyfile(p, Path(dst) / p.name)
        copied.append(p.name)
    return copied
