"""What both engine loops (the engine-core process's and an in-process engine's thread) share about
admission: the sequence cap (counted in one process, or across ``--api-server-count`` processes),
and round-robin hand-over by HTTP request."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

from ngrammar.sampling_params import InvalidRequestError

T = TypeVar("T")


def check_fits(num_sequences: int, max_queue: int) -> None:
    """Raise InvalidRequestError for a request of ``num_sequences`` that no wait would admit."""
    if num_sequences > max_queue:
        raise InvalidRequestError(
            f"the request asks for {num_sequences} sequences (prompts x n), more than the server's "
            f"queue of {max_queue} holds; send fewer prompts or a smaller n"
        )


class InflightCount:
    """Sequences admitted and not finished, in this process (event-loop thread only)."""

    def __init__(self) -> None:
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @property
    def own(self) -> int:
        """This process's part of ``count``."""
        return self._count

    def take(self, n: int, limit: int) -> bool:
        """Count ``n`` more if the total stays within ``limit``; False (nothing counted) otherwise."""
        if self._count + n > limit:
            return False
        self._count += n
        return True

    def give(self, n: int) -> None:
        self._count -= n


class SharedInflightCount(InflightCount):
    """The same count shared by every API server process: 8 bytes of a file they all map, changed
    under an exclusive ``flock`` (one per admission and per finish, never per token)."""

    _FORMAT = "<q"

    def __init__(self, path: str) -> None:
        super().__init__()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8:
                os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @property
    def count(self) -> int:
        return int(struct.unpack_from(self._FORMAT, self._map)[0])

    def take(self, n: int, limit: int) -> bool:
        with self._locked():
            total = self.count
            if total + n > limit:
                return False
            struct.pack_into(self._FORMAT, self._map, 0, total + n)
        self._count += n  # (this process's share, for its own books)
        return True

    def give(self, n: int) -> None:
        with self._locked():
            struct.pack_into(self._FORMAT, self._map, 0, self.count - n)
        self._count -= n

    def _locked(self) -> _Flock:
        return _Flock(self._fd)


class _Flock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class RoundRobin(Generic[T]):
    """Engine requests not yet handed to the engine: one FIFO per HTTP request (its group), taken
    one group at a time in turn, so a fan-out request (many prompts, large n) cannot put all its
    sequences ahead of a request that arrives after it."""

    def __init__(self) -> None:
        self._queues: OrderedDict[Hashable, deque[tuple[str, T]]] = OrderedDict()
        self._groups: dict[str, Hashable] = {}  # request id -> its group

    def __len__(self) -> int:
        return len(self._groups)

    def push(self, group: Hashable, request_id: str, item: T) -> None:
        self._queues.setdefault(group, deque()).append((request_id, item))
        self._groups[request_id] = group

    def pop(self) -> T:
        """The next group's oldest item; that group goes to the back of the rotation."""
        group, queue = next(iter(self._queues.items()))
        request_id, item = queue.popleft()
        del self._groups[request_id], self._queues[group]
        if queue:
            self._queues[group] = queue
        return item

    def remove(self, request_id: str) -> T | None:
        """Take out a request still waiting (None if it is not: handed over, or unknown)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        queue = self._queues[group]
        item = next(it for rid, it in queue if rid == request_id)
        queue.remove((request_id, item))
        if not queue:
            del self._queues[group]
        return item

    def items(self) -> list[T]:
        return [item for queue in self._queues.values() for _, item in queue]
