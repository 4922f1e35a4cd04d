"""uvicorn serving the HTTP API on a thread of the router process.

    server = HttpServer(app, threads=...)         # app: an ASGI app (app.HttpApi)
    port = server.start(host, port, tls=(cert, key) | None)   # port 0: any free one
    ...
    server.stop(grace)

The socket is bound here, before uvicorn starts, so `start` returns the port at once
and connections made before uvicorn's loop runs wait in the listen queue. uvicorn's
own signal handlers are not installed (it runs off the main thread): the router's
SIGTERM handling drains the front end, which both APIs share. httptools parses and
uvloop runs the loop (as `uvicorn[standard]` would, and vLLM does): against h11 on
asyncio's loop they took about 1 ms off the HTTP path's TTFT (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import uvicorn
import uvloop

log = logging.getLogger(__name__)
KEEPALIVE_S = 30  # idle keep-alive connections close after this long
START_TIMEOUT_S = 30.0


class HttpServer:
    def __init__(self, app: object, log_level: str = "warning") -> None:
        self.app = app
        self.log_level = log_level.lower()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int, tls: tuple[str, str] | None = None) -> int:
        """Bind host:port, serve on a thread; returns the bound port."""
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets (and the
        # connections they accept). Without it a response's headers and body, two writes,
        # meet Nagle and the client's delayed ACK: 40 ms a response.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as e:
            sock.close()
            raise OSError(f"http_port: cannot bind {host}:{port}: {e.strerror}") from None
        sock.listen(2048)
        bound = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level=self.log_level, access_log=False, timeout_keep_alive=KEEPALIVE_S, lifespan="off",
            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None, http="httptools",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock, started), name="http", daemon=True)
        self._thread.start()
        if not started.wait(START_TIMEOUT_S):
            raise RuntimeError(f"http: uvicorn did not start within {START_TIMEOUT_S:.0f}s")
        return bound

    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        server = self._server
        original = server.startup

        async def startup(sockets: list[socket.socket] | None = None) -> None:
            await original(sockets=sockets)
            started.set()

        server.startup = startup  # type: ignore[method-assign]
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(server.serve(sockets=[sock]))
        except BaseException:
            log.exception("http: the server stopped on an error")
        finally:
            started.set()
            sock.close()

    def stop(self, grace: float = 2.0) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(grace + 6.0)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(2.0)
