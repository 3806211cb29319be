"""Run the router: bind, build the replicas and the policy, serve with uvicorn until
SIGINT/SIGTERM. ``on_ready`` and ``stop`` let ``kvscope serve --data-parallel-size`` run it
beside the replicas it started."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable

from kvscope.engine.router.app import Router, create_app


async def serve_router(router: Router, sock: socket.socket, log_level: str = "warning",
                       ready_line: str = "", stop: asyncio.Event | None = None,
                       on_ready: Callable[[], None] | None = None) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202 - the signals are ours
            yield

    config = uvicorn.Config(create_app(router), log_level=log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = Server(config)
    stop = stop or asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    await router.start()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if ready_line:
            print(ready_line, flush=True)
        if on_ready is not None:
            on_ready()
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        server.should_exit = True
        await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            aio.remove_signal_handler(sig)
        await router.close()

