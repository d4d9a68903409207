"""Progress of the running step, for people watching it.

One small hook for every stage: the asset factory opens a `step` around each stage run,
the item cache opens a `track`ed task over the items it has to compute, and the LLM and
sandbox resources `count` what they did (completions and tokens, sandbox jobs: the counting
wrappers are `llm.counting.CountingLLM` and `sandbox_resource.CountingSandbox`). The step
logs its progress at INFO every 10% (so the run's page in the UI shows it), and a
console, when one is installed (`rstar demo`), prints one line per asset as it starts
and ends and draws a bar with rates and the time left. Nothing here knows Dagster.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

MILESTONES = 10  # log a task's progress every 1/MILESTONES of it

_lock = threading.RLock()
_step: Step | None = None
_console: Console | None = None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class Task:
    """Items of one batch of work (one `ItemCache.map` call) and what they cost."""

    step: Step
    total: int
    cached: int = 0
    done: int = 0
    counts: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    _milestone: int = 0

    def advance(self, n: int) -> None:
        with _lock:
            self.done += n
            reached = self.done * MILESTONES // self.total if self.total else MILESTONES
            if reached > self._milestone:
                self._milestone = reached
                self.step.log.info(self.line())
            if _console is not None:
                _console.task(self)

    def rates(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rates = {"items/s": self.done / elapsed}
        if self.counts["completions"]:
            rates["completions/s"] = self.counts["completions"] / elapsed
            rates["tokens/s"] = self.counts["tokens"] / elapsed
        if self.counts["sandbox_jobs"]:
            rates["sandbox jobs/s"] = self.counts["sandbox_jobs"] / elapsed
        return rates

    def eta(self) -> float | None:
        if not self.done:
            return None
        elapsed = time.monotonic() - self.started
        return elapsed / self.done * (self.total - self.done)

    def line(self) -> str:
        percent = 100 * self.done // self.total if self.total else 100
        parts = [f"{self.step.name}: {self.done}/{self.total} items ({percent}%)"]
        parts += [f"{value:.1f} {unit}" for unit, value in self.rates().items()]
        eta = self.eta()
        if eta is not None and self.done < self.total:
            parts.append(f"{_duration(eta)} left")
        if self.cached:
            parts.append(f"{self.cached} more from the cache")
        return ", ".join(parts)


@dataclass
class Step:
    """One asset's stage run."""

    asset: str
    partition: str | None
    log: logging.Logger | Any
    started: float = field(default_factory=time.monotonic)
    counts: Counter = field(default_factory=Counter)
    task: Task | None = None

    @property
    def name(self) -> str:
        return self.asset + (f"[{self.partition}]" if self.partition else "")

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def summary(self, rows: Mapping[str, int], figures: Mapping[str, float]) -> str:
        parts = [", ".join(f"{key} {n} rows" for key, n in rows.items())]
        parts += [f"{name} {value:.3g}" for name, value in figures.items()]
        if self.counts["completions"]:
            parts.append(
                f"{self.counts['completions']} completions, {self.counts['tokens']} tokens"
            )
        if self.counts["sandbox_jobs"]:
            parts.append(f"{self.counts['sandbox_jobs']} sandbox jobs")
        parts.append(f"{self.seconds():.1f} s")
        return f"{self.name}: " + ", ".join(parts)


@contextmanager
def step(asset: str, partition: str | None, log: logging.Logger | Any) -> Iterator[Step]:
    """The running step (one at a time per process: Dagster runs each step in its own
    process, or one after another in process)."""
    global _step
    current = Step(asset, partition, log)
    with _lock:
        _step = current
        if _console is not None:
            _console.started(current)
    try:
        yield current
    except BaseException:
        if _console is not None:
            _console.failed(current)
        raise
    finally:
        with _lock:
            _step = None


def finished(current: Step, rows: Mapping[str, int], figures: Mapping[str, float]) -> None:
    """The step's stage produced its tables: say so, with its rows and headline figures."""
    line = current.summary(rows, figures)
    current.log.info(line)
    if _console is not None:
        _console.finished(current, line)


@contextmanager
def track(total: int, cached: int = 0) -> Iterator[Task | None]:
    """A task of `total` items to compute (`cached` more came from the cache)."""
    with _lock:
        current = _step
        task = Task(current, total, cached) if current is not None and total else None
        if current is not None:
            current.task = task
    try:
        yield task
    finally:
        with _lock:
            if current is not None and current.task is task:
                current.task = None
            if task is not None and _console is not None:
                _console.task_done(task)


def count(**amounts: int) -> None:
    """Add what the LLM or the sandbox just did to the running step and task."""
    with _lock:
        if _step is None:
            return
        _step.counts.update(amounts)
        if _step.task is not None:
            _step.task.counts.update(amounts)
            if _console is not None:
                _console.task(_step.task)


class Console:
    """What `rstar demo` prints: a line when an asset starts and one when it ends, and
    while it computes, a bar (a terminal) or the 10% lines (a log or a pipe)."""

    BAR = 24

    def __init__(self, out: TextIO | None = None):
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self._drawn = False
        self._milestones: dict[int, int] = {}

    def _print(self, line: str) -> None:
        if self._drawn:
            self.out.write("\r\033[K")
            self._drawn = False
        self.out.write(line + "\n")
        self.out.flush()

    def started(self, step: Step) -> None:
        self._print(f"▶ {step.name}")

    def finished(self, step: Step, line: str) -> None:
        self._print(f"✔ {line}")

    def failed(self, step: Step) -> None:
        self._print(f"✘ {step.name}: failed after {step.seconds():.1f} s (see the event log)")

    def task(self, task: Task) -> None:
        if self.tty:
            filled = self.BAR * task.done // task.total
            bar = "█" * filled + "░" * (self.BAR - filled)
            self.out.write(f"\r\033[K  {bar} {task.line()}")
            self.out.flush()
            self._drawn = True
            return
        reached = task.done * MILESTONES // task.total
        if reached > self._milestones.get(id(task), 0):
            self._milestones[id(task)] = reached
            self._print(f"  {task.line()}")

    def task_done(self, task: Task) -> None:
        self._milestones.pop(id(task), None)
        if self._drawn:
            self._print(f"  {task.line()}")


@contextmanager
def console(out: TextIO | None = None) -> Iterator[Console]:
    """Install a console for the steps run in this process."""
    global _console
    installed = Console(out)
    with _lock:
        _console = installed
    try:
        yield installed
    finally:
        with _lock:
            _console = None
