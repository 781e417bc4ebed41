"""The compiled decode step without the wait: decode eagerly at once, and take the compiled step
between two tokens when it is ready.

A step saved by an earlier run is read in a thread (a few seconds of deserialising) and checked
against eager on the main thread before it is used. With none saved, a background process
(``python -m quantizer.runtime.decode.background MODEL_DIR THREADS MAX_LEN ARTIFACT``, on a core of
its own) compiles and saves it under an exclusive lock, so one compile serves every run that
follows, this one included once the file appears; a run that finds a compile under way starts
none and waits for its file the same way. ``int4q compile`` runs the same work in the foreground.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ...errors import InputError, UnsupportedError
from ...integrity import digest_path, matches_digest
from ...native.cache import UntrustedCache
from . import compiled as steps

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
WORKER_NICENESS = 10


def saved_step_ready(artifact: Path) -> bool:
    """Whether ``artifact`` is a step int4q finished saving (its sha256 recorded and matching)."""
    return artifact.is_file() and matches_digest(artifact)


@contextlib.contextmanager
def exclusive(artifact: Path, wait: bool = False):
    """Yields whether this process holds the artifact's compile lock (False: another one does;
    with ``wait``, once that one is done)."""
    artifact.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(artifact.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _workers_lock() -> int:
    """An open descriptor of the lock every background worker holds shared while it runs."""
    folder = steps.compiled_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return os.open(folder / "workers.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)


def worker_running() -> bool:
    """Whether a background compile (of any model) is running on this machine now."""
    with contextlib.suppress(OSError, UntrustedCache):
        fd = _workers_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def beside_one_core(threads: int) -> int:
    """The threads to run where a compiling worker holds one core: one fewer than ``threads``
    where they would take every core (a thread that shares the worker's core stalls every
    parallel region)."""
    return max(1, threads - 1) if threads >= len(os.sched_getaffinity(0)) else threads


def threads_beside_worker(threads: int) -> int:
    """``threads``, or :func:`beside_one_core` of it while a background compile runs."""
    return beside_one_core(threads) if worker_running() else threads


def compiling_elsewhere(artifact: Path) -> bool:
    """Whether another process holds the artifact's compile lock now."""
    with exclusive(artifact) as held:
        return not held


def compile_and_save(model_dir: Path, threads: int, max_len: int, artifact: Path | None = None) -> tuple[Path, str]:
    """Compile and save the decode step of the checkpoint ``model_dir`` at ``threads`` threads
    for sequences of up to ``max_len`` tokens. Returns (the artifact, what happened: "compiled",
    "already saved" or "being compiled"); InputError for a model that decodes through generate,
    UnsupportedError for a step that does not compile. Given its ``artifact`` (the background
    worker), it waits for a compile under way elsewhere before loading anything, and then finds
    the step saved."""
    model = decoder = None
    if artifact is None:
        model, decoder = _decoder_of(model_dir, threads, max_len)
        artifact = steps.artifact_path(model, decoder.variant)
    with exclusive(artifact, wait=decoder is None) as held:
        if not held:
            return artifact, "being compiled"
        if saved_step_ready(artifact):
            return artifact, "already saved"
        if decoder is None:
            model, decoder = _decoder_of(model_dir, threads, max_len)
            if steps.artifact_path(model, decoder.variant) != artifact:
                raise UnsupportedError(f"{model_dir}: the worker's decode step is not the one its run asked for")
        started = time.perf_counter()
        steps.compile_step(decoder, artifact)
        if decoder.compiled is None:
            raise UnsupportedError(f"{model_dir}: its decode step does not compile here (the warning above says why); "
                                   f"it decodes eagerly, and runs with the same key will not try again "
                                   f"(delete {steps.failed_marker(artifact)} to retry)")
        steps.record_compile_seconds(time.perf_counter() - started, decoder.layer_count)
    return artifact, "compiled"


def _decoder_of(model_dir: Path, threads: int, max_len: int):
    """(the loaded checkpoint, its decoder); InputError for a model that decodes through generate."""
    from ..loader import load_model

    model = load_model(model_dir, threads=threads)
    decoder = steps.new_decoder(model, max_len)
    if decoder is None:
        raise InputError(f"{model_dir}: this model decodes through transformers' generate, which has no step to "
                         "compile")
    return model, decoder


def start_worker(model_dir: Path, artifact: Path, max_len: int) -> subprocess.Popen | None:
    """A detached process compiling ``model_dir``'s step at this process's thread count (its
    output in ``<artifact>.log``); None when it cannot start."""
    command = [sys.executable, "-m", __name__, str(Path(model_dir).absolute()), str(torch.get_num_threads()),
               str(max_len), str(artifact)]
    try:
        artifact.parent.mkdir(parents=True, exist_ok=True)
        with open(artifact.with_suffix(".log"), "w") as out:
            worker = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    except OSError as e:
        log.info("cannot start the background compile: %s", e)
        return None
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, worker.pid, WORKER_NICENESS)  # the user's decode comes first
    return worker


class PendingStep:
    """A compiled step on its way: read from ``artifact`` in a thread once the file is ready.
    :meth:`poll`, called on the decoding thread between tokens, returns it (also ``step``) once
    it is read and matches eager, else None. A saved step that does not is removed and compiled again from
    ``source`` in the background, once. ``worker``: this run's compiling process; ``elsewhere``:
    another process was compiling the step when the run started."""

    def __init__(self, decoder, artifact: Path, source: Path, worker: subprocess.Popen | None = None,
                 elsewhere: bool = False):
        self.decoder, self.artifact, self.source, self.worker = decoder, artifact, source, worker
        self._elsewhere = elsewhere
        self.finished = False
        self.step = None
        self._retried = worker is not None
        self._thread: threading.Thread | None = None
        self._loaded: list = []
        self._next_look = 0.0
        self._threads = torch.get_num_threads()
        self._share_cores()

    def _share_cores(self) -> None:
        """While a worker compiles (on one core of its own), decode on the others."""
        if self.worker is not None or self._elsewhere:
            torch.set_num_threads(beside_one_core(self._threads))

    def _finish(self) -> None:
        self.finished = True
        torch.set_num_threads(self._threads)  # the step was compiled for the caller's thread count

    def poll(self):
        if self.finished:
            return self.step
        if self._thread is None:
            now = time.monotonic()
            if now < self._next_look:
                return None
            self._next_look = now + POLL_SECONDS
            if not saved_step_ready(self.artifact):
                if self._compile_ended():
                    self._finish()
                return None
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
            return None
        if self._thread.is_alive():
            return None
        step = self._loaded[0] if self._loaded else None
        if step is not None and steps.adopt_step(self.decoder, step, self.artifact):
            self.step = step
            self._finish()
            return step
        self._recompile()
        return None

    def _compile_ended(self) -> bool:
        """Whether the compile this run waits for has ended without saving a step."""
        if self.worker is not None:
            return self.worker.poll() not in (None, 0)
        if self._elsewhere and not compiling_elsewhere(self.artifact):
            return not saved_step_ready(self.artifact)  # saved as the lock was released: not ended
        return False

    def _recompile(self) -> None:
        """Drop the unusable saved step (int4q's own cache file) and compile it anew, once."""
        self._thread, self._loaded = None, []
        if self._retried:
            self._finish()
            return
        self._retried = True
        for path in (self.artifact, digest_path(self.artifact)):
            path.unlink(missing_ok=True)
        self.worker = start_worker(self.source, self.artifact, self.decoder.max_len)
        if self.worker is None:
            self._finish()
        else:
            self._share_cores()

    def wait(self, timeout: float | None = None):
        """Block until the step is ready (or ``timeout`` seconds pass); the step or None."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.finished and (end is None or time.monotonic() < end):
            self.poll()
            time.sleep(0.05)
        return self.step

    def _read(self) -> None:
        try:
            with steps.inductor_cache():
                self._loaded.append(steps.load_step(self.artifact, self.decoder))
        except Exception as e:  # a stale or damaged file: this run stays eager
            log.info("the saved step %s is unusable (%s)", self.artifact, e)


def main(argv: list[str]) -> int:
    """The background worker: compile on one core (the last this process may use), one compile
    job at a time, so the run that started it keeps the other cores."""
    import torch._inductor.config as inductor_config

    model_dir, threads, max_len, artifact = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    fcntl.flock(_workers_lock(), fcntl.LOCK_SH)  # held until the process ends: see worker_running
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    inductor_config.compile_threads = 1
    artifact, outcome = compile_and_save(model_dir, threads, max_len, artifact)
    print(f"{outcome}: {artifact}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
