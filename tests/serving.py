"""Helpers of the server tests: an app served by uvicorn on a free local port in a daemon thread,
and waiting for a server to go idle."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn


class UvicornThread:
    def __init__(self, app: Any) -> None:
        self.app = app
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def wait_idle(http: httpx.Client, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /server_info until nothing runs and every KV page is free; returns the last info."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = http.get("/server_info").json()
        idle = info["num_inflight"] == 0 and info["num_running"] == 0 and info["num_waiting"] == 0
        if idle and info["kv_pages_free"] == info["kv_pages_total"]:
            return info
        assert time.monotonic() < deadline, f"the server did not go idle: {info}"
        time.sleep(0.05)
