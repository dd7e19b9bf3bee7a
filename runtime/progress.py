"""Progress on the terminal while the daemon loads a model or runs a cold prefill.

The daemon's heartbeats carry the running request's progress (``contract.types.Progress``)
about once a second; ``ProgressDisplay`` is the client callback that draws it. It
draws nothing unless it is enabled (the CLI disables it for ``--json``), its
stream is a terminal, and the operation has run ``DELAY_S`` — so a warm turn,
which answers well within that, never flickers a bar. It draws with rich when
it is installed (the ``cli`` extra); without rich it prints a plain line every
``PLAIN_EVERY_S``. ``showing_progress`` points a client's ``on_progress`` at a
display for the duration of a block (a load, a turn's prefills).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from contract.types import Progress

if TYPE_CHECKING:
    from .client import Client

__all__ = ["DELAY_S", "PLAIN_EVERY_S", "ProgressDisplay", "showing_progress"]

#: an operation shows progress only once it has run this long
DELAY_S = 2.0
#: without rich, a plain progress line at most this often
PLAIN_EVERY_S = 2.0

_STAGES = {"load": "loading the model", "prefill": "prefill"}


def _label(p: Progress) -> str:
    return _STAGES.get(p.stage, p.stage or "working")


def _detail(p: Progress) -> str:
    return f"{p.done}/{p.total} tokens" if p.total else ""


class _Renderer(Protocol):
    def show(self, p: Progress) -> None: ...

    def close(self) -> None: ...


class _RichBar:
    """A transient rich bar: it is erased when the operation ends, leaving the output as it was."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        # Redrawn on each heartbeat (auto_refresh off: no thread), and stdout/stderr are left
        # alone: the reply streams to stdout once the bar is gone.
        self._bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=Console(file=stream),
            transient=True,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task: Any = None
        self._key: tuple[str, int] | None = None

    def show(self, p: Progress) -> None:
        total, completed = (p.total, p.done) if p.total else (100, round(p.fraction * 100))
        key = (p.stage, total)
        if self._task is None:
            self._bar.start()
            self._task = self._bar.add_task(_label(p), total=total, detail=_detail(p))
        elif key != self._key:  # the next operation of the block (the suffix after the prefix)
            self._bar.reset(self._task, total=total, description=_label(p))
        self._key = key
        self._bar.update(self._task, completed=completed, detail=_detail(p), refresh=True)

    def close(self) -> None:
        if self._task is not None:
            self._bar.stop()


class _PlainLines:
    """One line per ``PLAIN_EVERY_S``: ``modeld: prefill 37% (1536/4096 tokens)``."""

    def __init__(self, stream: TextIO, clock: Callable[[], float]) -> None:
        self._stream = stream
        self._clock = clock
        self._last = float("-inf")

    def show(self, p: Progress) -> None:
        now = self._clock()
        if now - self._last < PLAIN_EVERY_S:
            return
        self._last = now
        detail = _detail(p)
        self._stream.write(f"modeld: {_label(p)} {p.fraction * 100:.0f}%" + (f" ({detail})" if detail else "") + "\n")
        self._stream.flush()

    def close(self) -> None:
        pass


class ProgressDisplay:
    """The ``on_progress`` callback that draws heartbeat progress on a terminal; see the module docstring."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        delay_s: float = DELAY_S,
        clock: Callable[[], float] = time.monotonic,
        use_rich: bool | None = None,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and _is_terminal(self._stream)
        self._delay_s = delay_s
        self._clock = clock
        self._start = clock()
        #: None: rich when it is installed
        self._use_rich = use_rich
        self._renderer: _Renderer | None = None
        self._closed = False

    def __enter__(self) -> ProgressDisplay:
        self._start = self._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, p: Progress) -> None:
        if not self.enabled or self._closed or self._clock() - self._start < self._delay_s:
            return
        if self._renderer is None:
            self._renderer = self._make_renderer()
        self._renderer.show(p)

    def _make_renderer(self) -> _Renderer:
        if self._use_rich is not False:
            try:
                return _RichBar(self._stream)
            except ImportError:  # the client install without the `cli` extra
                if self._use_rich:
                    raise
        return _PlainLines(self._stream, self._clock)

    def close(self) -> None:
        """Erase the bar (idempotent); later progress is ignored."""
        self._closed = True
        if self._renderer is not None:
            self._renderer.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or foreign stream
        return False


@contextmanager
def showing_progress(client: Client, *, enabled: bool, stream: TextIO | None = None) -> Iterator[ProgressDisplay]:
    """Within the block, every request of ``client`` reports its progress to a ``ProgressDisplay``."""
    display = ProgressDisplay(enabled=enabled, stream=stream)
    previous = client.on_progress
    client.on_progress = display
    try:
        with display:
            yield display
    finally:
        client.on_progress = previous
