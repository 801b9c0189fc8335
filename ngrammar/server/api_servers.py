"""``ngrammar serve --api-server-count N``: N API server processes in front of the engine cores.

The HTTP side (parsing, tokenizing, detokenizing, SSE rendering, sockets) is per-token Python work
under one GIL per process; past one process it scales with cores. The supervisor (this module's
``serve_processes``, the ``ngrammar serve`` process) binds the listening socket, starts the engine
cores (``core_client.launch_cores``, one per ``--dp`` replica) and N API server processes
(``python -m ngrammar.server.api_servers SPEC``), each an ordinary server (``create_app``) with a
listening socket of its own on the same port (``SO_REUSEPORT``: the kernel spreads connections
over them) that talks to every core over its own ZeroMQ sockets (the cores route each
request's deltas to the process that sent it). Limits that span processes stay whole: the sequence
queue (``max_queue``) is one count in a shared file (``SharedInflightCount``), connections are
split (``max_connections`` / N each), and /metrics sums every process (prometheus-client's
multiprocess mode).

Shutdown: SIGINT (the terminal's, to the whole group) or SIGTERM (forwarded) drains every API
server process, then the supervisor stops the cores. An API server process that dies takes the
server down (the others are stopped, exit code 1); an API server process whose supervisor is gone
exits, as a core does.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from ngrammar.config import EngineConfig
from ngrammar.server.config import ServerConfig

if TYPE_CHECKING:
    import argparse

    import zmq

    from ngrammar.server.core_messages import Stop
    from ngrammar.server.http import DrainingServer

SPEC_FILE = "api.pickle"
INFLIGHT_FILE = "inflight"
METRICS_DIR = "metrics"
CONTROL_DIR = "control"
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ApiServerSpec:
    """What API server process ``index`` is started with (pickled into its folder)."""

    server: ServerConfig  # with its share of ``max_connections``
    engine: EngineConfig
    index: int
    count: int
    folder: str  # its sockets
    core_pids: tuple[int, ...]
    inflight_path: str  # the shared sequence count
    port: int  # the port every API server process listens on (SO_REUSEPORT)
    ready_fd: int  # written once connected to the cores
    go_fd: int  # its end-of-file: every API server process is ready, so all start listening at once
    stop_fd: int  # its end-of-file: drain and exit


def share(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split into ``parts`` as evenly as integers allow (at least 1)."""
    return max(1, total // parts + (index < total % parts))


def serve_processes(args: argparse.Namespace) -> int:
    """``ngrammar serve --api-server-count N`` (N > 1): run the supervisor until the API server
    processes end; their exit status."""
    from ngrammar.args import config_kwargs, engine_kwargs
    from ngrammar.llm import build_engine_config
    from ngrammar.server.core_client import bind_client, check_cores, launch_cores, stop_cores

    config = ServerConfig(**config_kwargs(args, ServerConfig))
    engine = build_engine_config(**engine_kwargs(args))
    count = config.api_server_count
    check_cores(engine)
    # Held (bound, never listening) for the server's life: the port is checked free now, and a
    # port 0 becomes one port that every API server process then shares.
    claim = bind_shared(config.host, config.port)
    port = int(claim.getsockname()[1])
    root = tempfile.mkdtemp(prefix="ngrammar-serve-")  # private (0700): every socket sits below it
    folders = [os.path.join(root, f"api-{i}") for i in range(count)]
    control = os.path.join(root, CONTROL_DIR)
    for folder in (*folders, control, os.path.join(root, METRICS_DIR)):
        os.mkdir(folder, 0o700)
    _, stops = bind_client(control, engine.data_parallel_size)
    cores = launch_cores(engine, folders, control)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.path.join(root, METRICS_DIR)}
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pipes = {ready_r, ready_w, go_r, go_w, stop_r, stop_w}  # open: each closed once (fds are reused)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for i, folder in enumerate(folders):
            spec = ApiServerSpec(
                dataclasses.replace(
                    config, max_connections=share(config.max_connections, count, i), port=port
                ),
                engine,
                i,
                count,
                folder,
                tuple(p.pid for p in cores),
                os.path.join(root, INFLIGHT_FILE),
                port,
                ready_w,
                go_r,
                stop_r,
            )
            path = os.path.join(folder, SPEC_FILE)
            with open(path, "wb") as f:
                pickle.dump(spec, f)
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ngrammar.server.api_servers", path, str(os.getpid())],
                    env=env,
                    pass_fds=(ready_w, go_r, stop_r),
                )
            )
        for fd in (ready_w, go_r, stop_r):
            _close(pipes, fd)
        if not _all_ready(ready_r, workers):
            return 1
        _close(pipes, go_w)  # every API server process starts listening
        return _supervise(workers, lambda: _close(pipes, stop_w))
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        for w in workers:
            try:
                w.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        stop_cores(cores, [_sender(s) for s in stops], _STOP_TIMEOUT_S)
        for s in stops:
            s.close(linger=0)
        claim.close()
        for fd in list(pipes):
            _close(pipes, fd)
        shutil.rmtree(root, ignore_errors=True)


def _close(pipes: set[int], fd: int) -> None:
    if fd in pipes:
        pipes.remove(fd)
        os.close(fd)


def _all_ready(ready: int, workers: list[subprocess.Popen[bytes]]) -> bool:
    """Wait until every API server process connected to the cores; False if one exited first."""
    exits = [os.pidfd_open(w.pid) for w in workers]
    try:
        heard = 0
        while heard < len(workers):
            readable, _, _ = select.select([ready, *exits], [], [])
            if any(fd in readable for fd in exits):
                print("ngrammar: an API server process exited while starting", file=sys.stderr)
                return False
            heard += len(os.read(ready, len(workers)))
        return True
    finally:
        for fd in exits:
            os.close(fd)


def bind_shared(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` in the port's ``SO_REUSEPORT`` group."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


def _sender(sock: zmq.Socket[bytes]) -> Callable[[Stop], None]:
    import zmq

    from ngrammar.server.core_messages import encoder

    def send(message: Stop) -> None:
        sock.send(encoder.encode(message), zmq.NOBLOCK, copy=False)

    return send


def _supervise(workers: list[subprocess.Popen[bytes]], stop: Callable[[], None]) -> int:
    """Wait for the API server processes: a stop signal drains them all (``stop`` closes a pipe: no
    signal of theirs, so a terminal's SIGINT, which reached them too, does not count twice), a
    second one ends them at once; one that ends on its own ends the others. Returns 0 after a
    requested stop, 1 otherwise."""
    stopping = threading.Event()

    def on_signal(sig: int, _: FrameType | None) -> None:
        if not stopping.is_set():
            stopping.set()
            stop()
            return
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGINT)  # (uvicorn: a SIGINT while draining exits at once)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    exits = [os.pidfd_open(w.pid) for w in workers]  # (a core's exit is its API servers' to answer: 503)
    try:
        select.select(exits, [], [])  # until the first one ends
    finally:
        for fd in exits:
            os.close(fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not stopping.is_set():
        print("ngrammar: an API server process exited; stopping the server", file=sys.stderr)
    return 0 if stopping.is_set() else 1


def api_server_main(path: str, parent: int) -> None:
    """One API server process: connect to the cores, then serve on the inherited socket until
    told to stop or until the supervisor is gone."""
    import uvicorn

    from ngrammar.server.admission import SharedInflightCount
    from ngrammar.server.app import create_app
    from ngrammar.server.core_client import connect_cores
    from ngrammar.server.http import DrainingServer, uvicorn_kwargs
    from ngrammar.server.process import tune_server_process

    tune_server_process()
    with open(path, "rb") as f:
        spec: ApiServerSpec = pickle.load(f)
    admitted = SharedInflightCount(spec.inflight_path)
    app = create_app(
        config=spec.server,
        connect=lambda metrics: connect_cores(
            spec.engine,
            spec.folder,
            spec.core_pids,
            spec.server.max_queue,
            metrics,
            client=spec.index,
            admitted=admitted,
        ),
    )
    server = DrainingServer(uvicorn.Config(app, log_level="info", **uvicorn_kwargs(spec.server)))
    os.write(spec.ready_fd, b"r")
    os.close(spec.ready_fd)
    os.read(spec.go_fd, 1)  # (end of file once the supervisor heard from every process)
    os.close(spec.go_fd)
    _watch_stop(parent, spec.stop_fd, server)
    listener = bind_shared(spec.server.host, spec.port)
    listener.listen(2048)
    server.run(sockets=[listener])


def _watch_stop(parent: int, stop: int, server: DrainingServer) -> None:
    """Drain and stop once the supervisor says so or is gone (a thread blocked on both)."""
    fd = os.pidfd_open(parent)

    def watch() -> None:
        select.select([fd, stop], [], [])
        server.should_exit = True

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: uvicorn drains this process's requests.
    api_server_main(sys.argv[1], int(sys.argv[2]))
