"""HTTP serving: OpenAI-compatible and native endpoints over a background engine loop."""

from ngrammar.server.app import create_app, serve
from ngrammar.server.config import ServerConfig
from ngrammar.server.engine_loop import AsyncEngine, EngineSnapshot, QueueFull, RequestGroup

__all__ = [
    "AsyncEngine",
    "EngineSnapshot",
    "QueueFull",
    "RequestGroup",
    "ServerConfig",
    "create_app",
    "serve",
]
