"""Test helper: the order in which a runner launches forwards and reads results back to the host."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ngrammar.runner.model_runner import ModelRunner


@contextmanager
def device_events(runner: ModelRunner, read: str = "read") -> Iterator[list[str]]:
    """Yields a list that gets "forward" at every forward launch and ``read`` at every
    device->host read of ``runner`` while the block runs; the hooks are removed afterwards."""
    events: list[str] = []
    runner.on_forward = lambda: events.append("forward")
    runner.on_to_host = lambda: events.append(read)
    try:
        yield events
    finally:
        runner.on_forward = None
        runner.on_to_host = None
