"""Publishing a quantized folder to the Hugging Face Hub (or any server speaking its API), with a
generated model card. The token is passed to huggingface_hub and never printed or written."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, Int4qError
from ..formats import RUNTIME_FORMAT, format_of_config
from ..io.aux_files import leaves
from ..io.outdir import write_new_file
from .card import CARD_NAME, model_card, read_json

log = logging.getLogger(__name__)
RETRIES = 3  # attempts for a push that fails on a connection error or a 5xx


class PushError(Int4qError):
    """The server refused or could not be reached."""


@dataclass(frozen=True)
class UploadFile:
    path: str  # relative, POSIX
    size: int


def upload_files(folder: Path) -> list[UploadFile]:
    """What a push sends: every file under ``folder`` except hidden ones (partial runs, caches).
    InputError names a link that resolves outside the folder (or nowhere): it is never sent."""
    root = Path(folder).resolve()
    files = []
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_symlink() and (not p.exists() or leaves(p, [root])):
            raise InputError(f"{p} is a link to {os.readlink(p)}, outside {folder}; push sends only the folder's own "
                             "files: replace the link with the file, or remove it")
        if p.is_file():
            files.append(UploadFile(rel.as_posix(), p.stat().st_size))
    return files


def check_publishable(folder: Path) -> None:
    """Raise InputError unless the folder is one verify would pass: its structural check passes
    (GPTQ-format exports: their shards are readable), its tokenizer loads, and a verify report
    saved in it, if any, says PASS."""
    from ..io.checkpoint import CheckpointReader, read_config
    from ..io.tokenizer import load_tokenizer
    from ..verification.structure import check_structure

    fmt = format_of_config(read_config(folder).get("quantization_config") or {})
    if fmt is not None and fmt.name != RUNTIME_FORMAT:
        CheckpointReader(folder)
    else:
        result, _ = check_structure(folder)
        if not result.ok:
            more = f" (and {len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
            raise InputError(f"{folder} fails verify's structural check: {result.problems[0]}{more}; "
                             "fix it or pass --no-verify")
    load_tokenizer(folder)
    report = read_json(folder / "verify_report.json")
    if isinstance(report, dict):
        outcome = report.get("outcome") or ("PASS" if report.get("ok") else "FAIL")
        if outcome != "PASS":
            raise InputError(f"{folder}/verify_report.json says {outcome}; run int4q verify again once it passes, "
                             "or pass --no-verify")


def _describe(e: Exception, token: str | None) -> str:
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    if status == 401 and token is None:
        return "the server needs a token (401 Unauthorized); pass --token, set HF_TOKEN or run `hf auth login`"
    if status == 401:
        return "the server refused the token (401 Unauthorized); check --token or HF_TOKEN"
    if status == 403:
        return "the token may not write to this repository (403 Forbidden)"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"{first}" if status is None else f"HTTP {status}: {first}"


def _transient(e: Exception) -> bool:
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status is not None:
        return status >= 500 or status == 429
    return isinstance(e, (OSError, ConnectionError)) or type(e).__module__.startswith(("httpx", "httpcore"))


def push(folder: Path, repo_id: str, token: str | None, endpoint: str | None, private: bool,
         revision: str | None, commit_message: str | None, show_bars: bool = False) -> str:
    """Create the repository (existing is fine), write a model card if there is none, and upload
    the folder in one commit. Returns the commit URL."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    # huggingface_hub's upload bars (rate, ETA) on a terminal only; the CLI closes them before an error line.
    enable_progress_bars() if show_bars else disable_progress_bars()
    folder = Path(folder)
    card = folder / CARD_NAME
    wrote_card = not os.path.lexists(card)  # a link named README.md, even a dangling one, is the user's
    if wrote_card:
        write_new_file(card, model_card(folder, repo_id))
    try:
        return _upload(folder, repo_id, token, endpoint, private, revision, commit_message)
    except BaseException:
        if wrote_card:  # a failed push leaves the folder as it was
            card.unlink(missing_ok=True)
        raise


def _upload(folder: Path, repo_id: str, token: str | None, endpoint: str | None, private: bool,
            revision: str | None, commit_message: str | None) -> str:
    """One commit with everything in ``folder``, retried on transient failures."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    last: Exception | None = None
    for attempt in range(1, RETRIES + 1):
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                     commit_message=commit_message or "Upload int4q checkpoint",
                                     ignore_patterns=[".*", "**/.*"])
            return info.commit_url
        except Exception as e:  # huggingface_hub raises its own and httpx's types
            last = e
            if not _transient(e) or attempt == RETRIES:
                break
            log.warning("push attempt %d failed (%s); retrying", attempt, _describe(e, token))
            time.sleep(2 ** (attempt - 1))
    raise PushError(f"push to {repo_id} failed: {_describe(last, token)}")


def resolve_token(token: str | None) -> str | None:
    """--token, else HF_TOKEN, else the token huggingface_hub has stored."""
    if token:
        return token
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    from huggingface_hub import get_token

    return get_token()


