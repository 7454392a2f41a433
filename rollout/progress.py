"""The console bar of long work: rollout samples done out of samples started so far, and the same bar for sft's and
indexer-warmup's steps, export's and the convert tools' weight files."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class SampleProgress:
    """A transient rich bar (it leaves no lines behind) whose total grows as work starts, so it never overshoots.

    Drawn on stderr, beside the step lines, and only when stderr is an interactive terminal (a log file or a pipe
    would get a blank line per bar); does nothing when `show` is False."""

    def __init__(self, label: str, total: int = 0, show: bool = True) -> None:
        self.label, self.total, self.done = label, total, 0
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        console = Console(stderr=True) if show else None
        if console is not None and console.is_interactive:
            self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self) -> SampleProgress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, error, trace)

    def add_total(self, count: int) -> None:
        """`count` more samples started."""
        self.total += count
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def advance(self, count: int) -> None:
        """`count` samples finished."""
        self.done += count
        if self._bar is not None:
            self._bar.advance(self._task, count)
