"""The uvicorn server behind `run_server`: SIGTERM drains the `OpenAIServing` instead of cutting it off.

On SIGTERM (or SIGINT) `serving.draining` turns on (health answers 503, new requests are refused), uvicorn
stops accepting and waits for running requests; after `shutdown_timeout` seconds the ones left are ended
properly by `serving.abort_running()` (an error event and `[DONE]` for a stream, a 503 otherwise),
before uvicorn's own, later deadline (`timeout_graceful_shutdown`) would cancel their tasks mid-chunk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from asyncexec.entrypoints.api_server import OpenAIServing

__all__ = ["ABORT_GRACE_S", "DrainingServer", "serve_draining"]

logger = logging.getLogger(__name__)
ABORT_GRACE_S = 5  # uvicorn's own drain deadline comes this long after ours, as a backstop


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` over `config`, draining `serving` for up to `shutdown_timeout` seconds on exit.

    `config.timeout_graceful_shutdown` should be `shutdown_timeout + ABORT_GRACE_S`.
    """

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, shutdown_timeout: int) -> None:
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.serving.draining:
            logger.info("draining: finishing running requests for up to %d s", self.shutdown_timeout)
        self.serving.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        # Ours comes first: requests still running then end properly, and uvicorn (which would cancel
        # their tasks mid-chunk) finds nothing left to cut.
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.shutdown_timeout, self.serving.abort_running)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve_draining(
    app: Starlette, serving: OpenAIServing, host: str, port: int, log_level: str, shutdown_timeout: int
) -> None:
    """Serve `app` (whose routes are `serving`'s) with uvicorn until SIGINT or SIGTERM, then drain."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout + ABORT_GRACE_S,
        access_log=False,
    )
    DrainingServer(config, serving, shutdown_timeout).run()
