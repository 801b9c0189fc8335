"""Starting ngrammar's tensor-parallel rank processes (engine cores, ``--dp`` replicas included, are
fresh interpreters started by ``server/core_client.py``).

Children run only ngrammar's entry points, so they must not re-run the user's script:
multiprocessing's "spawn" start method imports the parent's ``__main__`` in every child, which
builds the engine again there, or fails with a bootstrap error where the script has no
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any


def spawn(
    ctx: SpawnContext, target: Callable[..., Any], args: tuple[Any, ...], name: str, daemon: bool
) -> BaseProcess:
    """Start ``target(*args)`` in a fresh interpreter that does not import the parent's ``__main__``
    (``target`` and ``args`` must pickle by reference to ngrammar's modules)."""
    process = ctx.Process(target=target, args=args, name=name, daemon=daemon)
    main = sys.modules["__main__"]
    # The start reads __main__'s spec and file synchronously (multiprocessing.spawn's
    # get_preparation_data): a stand-in without either makes the child skip it.
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        process.start()
    finally:
        sys.modules["__main__"] = main
    return process
