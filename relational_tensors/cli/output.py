"""The command line's output: rich text for people, JSON for programs, errors on stderr, and the
progress bar of long compiles.

The compiler logs each pass's start at DEBUG on ``relational_tensors.compile`` with the extra fields
``rt_pass``, ``rt_index`` and ``rt_total``; while :func:`compile_progress` is active a handler turns them
into a transient rich progress bar, shown only once the compile has run for a second.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Ui", "compile_progress", "jsonable", "strict_json"]


@dataclass
class Ui:
    """Where output goes: rich text for people, JSON for programs, errors on stderr."""

    json: bool
    quiet: bool
    debug: bool

    def __post_init__(self) -> None:
        from rich.console import Console

        # piped output gets a width that fits the plan table instead of rich's default 80 columns
        self.out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
        self.err = Console(stderr=True, highlight=False)

    @property
    def people(self) -> bool:
        """True when decorated, human output is wanted."""
        return not (self.json or self.quiet)

    def say(self, text: str, markup: bool = True) -> None:
        if self.people:
            self.out.print(text, markup=markup)

    def text(self, text: str) -> None:
        """Already-formatted text (tables), printed unchanged unless --json."""
        if not self.json:
            self.out.file.write(text if text.endswith("\n") else text + "\n")

    def result(self, obj: Any) -> None:
        print(json.dumps(strict_json(obj), indent=1, default=jsonable, allow_nan=False))

    def compiling(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A progress bar on stderr, by pass, once a compile has run for a second; people at a terminal only."""
        return compile_progress(self.err if self.people and self.err.is_terminal else None, what)

    @contextlib.contextmanager
    def status(self, what: str) -> Iterator[None]:
        """A spinner on stderr while something runs, for people at a terminal only."""
        if self.people and self.err.is_terminal:
            with self.err.status(what):
                yield
        else:
            yield


def strict_json(x: Any) -> Any:
    """``x`` with every NaN or infinite float as null: JSON has no spelling for them."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def jsonable(x: Any) -> Any:
    if hasattr(x, "isoformat"):
        return x.isoformat()
    if hasattr(x, "item"):
        return strict_json(x.item())
    if isinstance(x, (bytes, bytearray)):
        return x.hex()
    return str(x)


@contextlib.contextmanager
def compile_progress(console: Any, what: str, after_s: float = 1.0) -> Iterator[None]:
    """Show the passes of the compiles inside this block on ``console`` (a rich Console; None: nothing)."""
    if console is None:
        yield
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.monotonic()
    bar: list[Any] = []  # the Progress and its task, once shown

    class Passes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            name = getattr(record, "rt_pass", None)
            if name is None:
                return
            if not bar and time.monotonic() - started >= after_s:
                progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                    TextColumn("{task.completed}/{task.total} passes"), TimeElapsedColumn(),
                                    console=console, transient=True)
                progress.start()
                bar.extend((progress, progress.add_task(what, total=getattr(record, "rt_total", None))))
            if bar:
                bar[0].update(bar[1], completed=getattr(record, "rt_index", 0), description=f"{what}: {name}")

    logger, handler = logging.getLogger("relational_tensors.compile"), Passes(logging.DEBUG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if bar:
            bar[0].stop()
