"""Models named by Hub id: fetching a source checkpoint, and telling a Hub id from a local path."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import InputError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_hub_id(name: str | None) -> bool:
    """``owner/name`` with Hub-legal characters and no local folder of that name."""
    return bool(name) and HUB_ID.fullmatch(name) is not None and not Path(name).exists()


def base_model_id(named: str, config: dict, explicit: str | None = None) -> str | None:
    """The Hub id of the model a quantization was made from, for the card's ``base_model``: the
    one given (``--base-model``), else ``--model`` when it was a Hub id, else the source config's
    ``_name_or_path`` when that is one; None when none is known (a local path is never one)."""
    if explicit and not looks_like_hub_id(explicit):
        raise InputError(f"--base-model {explicit}: not a Hub id (owner/name); give the id the source was downloaded as")
    for candidate in (explicit, named, config.get("_name_or_path")):
        if looks_like_hub_id(candidate):
            return candidate
    return None


def resolve_model_dir(model: str) -> Path:
    """A local folder as is; otherwise treat ``model`` as a Hub repo id and fetch its files."""
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{model} is a file; --model takes a model folder or a Hub repo id")
        return path
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise InputError(f"{model}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
            )
        )
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{model}: not a local folder and could not be fetched from the Hub ({reason})") from None
