"""Progress the way people expect it on stderr: on a terminal a tqdm bar with a rate and an ETA;
when stderr is not a terminal (a log, CI), plain lines with the same numbers: one as a step
starts, one per finished unit (per :data:`INTERVAL` for byte counts), and one at least every
:data:`INTERVAL` seconds while a unit takes longer. Presentation only: the core reports (label,
done, total)."""

from __future__ import annotations

import sys
import threading
import time
import weakref

import click

INTERVAL = 10.0
"""Seconds between plain lines at most, while a step runs."""


def is_terminal() -> bool:
    """Whether stderr is a terminal: bars there, plain lines elsewhere."""
    return sys.stderr.isatty()


class Steps:
    """One long step: ``total`` units of ``unit`` named ``label``."""

    def __init__(self, label: str, total: int, unit: str = "step", enabled: bool = True, done: int = 0,
                 interval: float = INTERVAL):
        self.label, self.total, self.unit, self.enabled, self.interval = label, total, unit, enabled, interval
        self.done, self.first, self.started = done, done, time.perf_counter()
        self.bar, self.last_line, self._lock, self._stop = None, self.started, threading.Lock(), threading.Event()
        if enabled and is_terminal():
            from tqdm import tqdm

            scale = unit == "B"
            self.bar = tqdm(total=total, initial=done, desc=label, unit=unit, unit_scale=scale, file=sys.stderr,
                            leave=True)
        elif enabled:
            self._line("")
            threading.Thread(target=_heartbeat, args=(weakref.ref(self), self._stop), name="int4q-progress",
                             daemon=True).start()

    def update(self, done: int, note: str = "") -> None:
        """``done`` units are finished (a running count); ``note`` says what the last one did."""
        step, self.done = done - self.done, done
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(step)
        elif self.enabled and step > 0 and (done >= self.total or self.unit != "B"
                                            or time.perf_counter() - self.last_line >= self.interval):
            self._line(note)

    def _line(self, note: str) -> None:
        with self._lock:
            self.last_line = time.perf_counter()
            click.echo(f"int4q: {self.label} {self._count()}{' ' + note if note else ''} ({self._rate()})", err=True)

    def beat(self) -> float:
        """A line if :attr:`interval` passed without one; the seconds until the next one is due."""
        now = time.perf_counter()
        if now - self.last_line >= self.interval and self.done < self.total:
            self._line(f"running for {now - self.started:.0f} s")
        return max(self.interval - (time.perf_counter() - self.last_line), 0.05)

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
        self._stop.set()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _heartbeat(step: "weakref.ref[Steps]", stop: threading.Event) -> None:
    """The step's lines while it runs; ends when it closes or is forgotten unclosed."""
    wait = 0.05
    while not stop.wait(wait):
        steps = step()
        if steps is None:
            return
        wait = steps.beat()
        del steps


class StepReporter:
    """A ``progress(label, done, total, note)`` callback for the core: one :class:`Steps` per label."""

    def __init__(self, enabled: bool = True, unit: str = "step"):
        self.enabled, self.unit, self.open = enabled, unit, {}

    def __call__(self, label: str, done: int, total: int, note: str = "", unit: str | None = None) -> None:
        """``done`` of ``total`` (in ``unit``, default the reporter's); the first call for a label
        starts its clock (call it with the count already done, 0 or a resumed count, before the
        work starts)."""
        steps = self.open.get(label)
        if steps is None:
            steps = self.open[label] = Steps(label, total, unit or self.unit, self.enabled, done=done)
        steps.update(done, note)
        if done >= total:
            self.open.pop(label).close()

    def close(self) -> None:
        for steps in self.open.values():
            steps.close()
        self.open.clear()
