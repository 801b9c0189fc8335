"""What both engine loops (the engine-core process's and an in-process engine's thread) share about
admission: the sequence cap, and round-robin hand-over by HTTP request."""

from __future__ import annotations

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
