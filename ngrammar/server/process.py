"""Settings of the server's own processes (the engine cores, the API servers, the single-process
server), applied once at their entry points; never in a process that merely imports ngrammar."""

from __future__ import annotations

import sys

# CPython's switch interval (5 ms by default) is how long a thread that released the GIL in a C call
# (a ZeroMQ send, an xgrammar call, a socket write) may wait to take it back while another thread runs
# Python. A server process has such threads (request preparation, grammar compiles, corpus calls), and
# each wait lands on a request's latency; at 50 us a forced switch costs far less than it saves.
SWITCH_INTERVAL_S = 5e-5


def tune_server_process() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
