"""The agent endpoint's HTTP server: FastAPI served by uvicorn, one per process, on the
agents' event loop (`AgentLoop`), started on first use; its routes hand each request to
the session its URL names (`flowgraph.agent.sessions`).

Routes, under `/s/<session>/v1`: `POST chat/completions`, `POST completions`,
`GET models`.

Security: the server listens on 127.0.0.1 only, on a port the OS picks; each session
id is 32 random bytes (`secrets.token_urlsafe`, chosen by `Sessions`); a request to an
unknown or closed session is refused (404).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol

from flowgraph.agent.episodes import AgentLoop, describe
from flowgraph.agent.wire import EndpointError, error_body

__all__ = ["Served", "Server"]


class Served(Protocol):
    """A session as the routes see it (`flowgraph.agent.sessions.Session`)."""

    @property
    def done(self) -> bool: ...

    @property
    def model_name(self) -> str: ...

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completions request's answer: one sampled turn."""

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """A completions request's answer: one sampled turn."""

    def fail(self, exc: Exception) -> None:
        """End the episode with `exc`: a request flowgraph could not answer."""


class Server:
    """The process's endpoint. Sessions come and go with episodes."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _one: ClassVar[Server | None] = None

    def __init__(self) -> None:
        self.sessions: dict[str, Served] = {}
        self._http: Any = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)  # connections wait in the backlog until uvicorn serves
        self.port: int = self.sock.getsockname()[1]
        import uvicorn

        config = uvicorn.Config(_app(self), log_level="warning", lifespan="off",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.serving = AgentLoop.submit(self.server.serve(sockets=[self.sock]))

    def http(self) -> Any:
        """The HTTP client every episode's `AsyncOpenAI` sends through (one connection
        pool: making one per client costs ~20 ms, an SSL context each). It ignores the
        environment's HTTP(S)_PROXY, which would carry loopback requests to a cluster's
        proxy."""
        if self._http is None:
            from openai import DefaultAsyncHttpxClient

            self._http = DefaultAsyncHttpxClient(trust_env=False)
        return self._http

    @classmethod
    def get(cls) -> Server:
        with cls._lock:
            if cls._one is None:
                cls._one = Server()
            return cls._one

    def url(self, sid: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def session(self, sid: str) -> Served:
        found = self.sessions.get(sid)
        if found is None or found.done:
            raise EndpointError(404, "unknown or closed session: each episode's client has "
                                     "its own base_url, valid while the episode runs")
        return found


def _app(server: Server) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse(error_body(status, message), status)

    app = FastAPI(title="flowgraph agent endpoint", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def answer(route_of: Callable[[Served], Callable[[dict[str, Any]],
                                                     Awaitable[dict[str, Any]]]]
               ) -> Callable[[str, Request], Awaitable[JSONResponse]]:
        async def route(sid: str, request: Request) -> JSONResponse:
            try:
                session = server.session(sid)
            except EndpointError as exc:
                return _error(exc.status, str(exc))
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise EndpointError(400, "the request's body is not a JSON object")
                return JSONResponse(await route_of(session)(body))
            except EndpointError as exc:
                return _error(exc.status, str(exc))
            except Exception as exc:  # a bug of ours, or a tokenizer's: the episode's error
                session.fail(exc)
                return _error(500, f"flowgraph could not answer: {describe(exc)}")
        # real classes, not this module's postponed annotations: FastAPI reads them
        route.__annotations__ = {"sid": str, "request": Request, "return": JSONResponse}
        return route

    async def models(sid: str) -> JSONResponse:
        try:
            session = server.session(sid)
        except EndpointError as exc:
            return _error(exc.status, str(exc))
        return JSONResponse({"object": "list", "data": [
            {"id": session.model_name, "object": "model", "created": 0,
             "owned_by": "flowgraph"}]})

    models.__annotations__ = {"sid": str, "return": JSONResponse}
    app.get("/s/{sid}/v1/models")(models)
    app.post("/s/{sid}/v1/chat/completions")(answer(lambda s: s.chat))
    app.post("/s/{sid}/v1/completions")(answer(lambda s: s.completion))
    return app
