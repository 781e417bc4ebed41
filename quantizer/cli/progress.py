"""Progress the way people expect it on stderr: on a terminal a tqdm bar with a rate and an ETA;
when stderr is not a terminal (a log, CI), plain lines with the same numbers, at most one per
tenth of the work for byte counts. Presentation only: the core reports (label, done, total)."""

from __future__ import annotations

import sys
import time

import click


def is_terminal() -> bool:
    """Whether stderr is a terminal: bars there, plain lines elsewhere."""
    return sys.stderr.isatty()


class Steps:
    """One long step: ``total`` units of ``unit`` named ``label``."""

    def __init__(self, label: str, total: int, unit: str = "step", enabled: bool = True, every: float = 0.0,
                 done: int = 0):
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.every = every  # plain lines: only after this fraction of the total more is done
        self.done, self.first, self.started, self.last_shown = done, done, time.perf_counter(), done
        self.bar = None
        if enabled and is_terminal():
            from tqdm import tqdm

            scale = unit == "B"
            self.bar = tqdm(total=total, initial=done, desc=label, unit=unit, unit_scale=scale, file=sys.stderr,
                            leave=True)

    def update(self, done: int, note: str = "") -> None:
        """``done`` units are finished (a running count); ``note`` says what the last one did."""
        step, self.done = done - self.done, done
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(step)
        elif self.enabled and done > self.last_shown and (done >= self.total
                                                            or done - self.last_shown >= self.every * self.total):
            self.last_shown = done
            click.echo(f"int4q: {self.label} {self._count()}{' ' + note if note else ''} ({self._rate()})", err=True)

    def _count(self) -> str:
        if self.unit == "B":
            return f"{self.done / 1e6:.0f}/{self.total / 1e6:.0f} MB"
        return f"{self.done}/{self.total}"

    def _rate(self) -> str:
        elapsed = time.perf_counter() - self.started
        if self.done == self.first or elapsed <= 0:
            return "starting"
        rate = (self.done - self.first) / elapsed
        eta = (self.total - self.done) / rate
        if self.unit == "B":
            shown = f"{rate / 1e6:.1f} MB/s"
        else:
            shown = f"{rate:.2f} {self.unit}/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}"
        return f"{shown}, ETA {eta:.0f} s"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepReporter:
    """A ``progress(label, done, total, note)`` callback for the core: one :class:`Steps` per label."""

    def __init__(self, enabled: bool = True, unit: str = "step"):
        self.enabled, self.unit, self.open = enabled, unit, {}

    def __call__(self, label: str, done: int, total: int, note: str = "") -> None:
        """``done`` of ``total``; the first call for a label starts its clock (call it with the
        count already done, 0 or a resumed count, before the work starts)."""
        steps = self.open.get(label)
        if steps is None:
            steps = self.open[label] = Steps(label, total, self.unit, self.enabled, done=done)
        steps.update(done, note)
        if done >= total:
            self.open.pop(label).close()

    def close(self) -> None:
        for steps in self.open.values():
            steps.close()
        self.open.clear()
