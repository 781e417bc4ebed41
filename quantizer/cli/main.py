"""The ``int4q`` command group: turns errors into one line and an exit code (1; 2 for bad usage;
130 when interrupted). Each command lives in the module of its family."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import traceback

import click

from ..errors import Int4qError, InterruptedRun, UsageError


class Int4qGroup(click.Group):
    """Maps library errors to one line on stderr and exit 1; never prints a traceback unless
    INT4Q_DEBUG=1. SIGTERM and SIGHUP stop a command as Ctrl-C does: its partial output is
    removed (or kept for --resume), and the exit code is 128 + the signal."""

    def invoke(self, ctx):
        previous = {s: signal.signal(s, _stop) for s in STOP_SIGNALS}
        try:
            return super().invoke(ctx)
        except BaseException as e:
            _close_progress_bars()  # so the message starts a line of its own
            if isinstance(e, (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit)):
                raise
            self._exit_for(e)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @staticmethod
    def _exit_for(e: BaseException):
        kept = ""
        if isinstance(e, InterruptedRun):
            e, kept = e.cause, e.kept
        if isinstance(e, UsageError):
            raise click.UsageError(str(e) + kept) from None
        if isinstance(e, Int4qError):
            raise click.ClickException(_rank_prefix(e) + str(e) + kept) from None
        if isinstance(e, Stopped):
            click.echo(f"int4q: stopped by {e.signal.name}" + kept, err=True)
            sys.exit(128 + e.signal)
        if isinstance(e, KeyboardInterrupt):
            click.echo("int4q: interrupted" + kept, err=True)
            sys.exit(130)
        if isinstance(e, MemoryError):
            raise click.ClickException("out of memory" + kept) from None
        if isinstance(e, OSError) and e.errno in OS_ERRORS:
            where = e.filename or "the output"
            raise click.ClickException(OS_ERRORS[e.errno].format(where=where) + kept) from None
        # An unexpected failure: still one line, with a way to see more.
        if os.environ.get("INT4Q_DEBUG") == "1":
            traceback.print_exc()
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise click.ClickException(
            f"{_rank_prefix(e)}internal error: {type(e).__name__}: {first} (set INT4Q_DEBUG=1 for the traceback)" + kept
        ) from None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # kill, timeout, schedulers, a closed terminal


class Stopped(BaseException):
    """A stop signal arrived; raised where the program was, so every cleanup on the way out runs."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signal = signal.Signals(signum)


def _stop(signum, frame):
    raise Stopped(signum)


OS_ERRORS = {
    errno.ENOSPC: "no space left on the device while writing {where}; free space or choose another --out",
    errno.EDQUOT: "disk quota exceeded while writing {where}; free space or choose another --out",
    errno.EACCES: "permission denied: {where}; make it readable if int4q reads it, writable if it writes it, or "
                  "choose another path",
    errno.EPERM: "operation not permitted: {where}; make it readable if int4q reads it, writable if it writes it, "
                 "or choose another path",
    errno.EROFS: "read-only file system: {where}; choose a writable folder",
    errno.ENOTDIR: "{where}: a part of that path is a file, not a folder; choose another path",
}


def _rank_prefix(e: BaseException) -> str:
    """Under torchrun every rank's error says which rank it is (a lost peer's already does)."""
    from ..calibrate.ranks import RankLost, in_launcher

    if not in_launcher() or isinstance(e, RankLost):
        return ""
    return f"rank {os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']}: "


def _close_progress_bars() -> None:
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


@click.group(cls=Int4qGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
@click.version_option(package_name="int4q")
def main(verbose: bool) -> None:
    """int4q: 4-bit group-wise checkpoints for CPU inference."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="int4q: %(message)s")


def _register() -> None:
    from .publish import push, verify
    from .quantize import bundled_model, quantize
    from .runtime import bench, compile_step, generate
    from .setup import setup_gguf

    for command in (quantize, bundled_model, generate, bench, compile_step, verify, push, setup_gguf):
        main.add_command(command)


_register()
