"""`python -m services.gateway --model MODEL.gguf --port 8000`: run the gateway.

Flags and their SKIFF_* environment variables are in config.py; `--help` lists them without
importing the HTTP or ZMQ stacks.
"""

from __future__ import annotations

import logging
import sys

from services.gateway.config import GatewayConfig


def main(argv: list[str] | None = None) -> int:
    config = GatewayConfig.from_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from aiohttp import web  # imported after parsing so that --help stays instant

    from services.gateway.app import create_app

    app = create_app(config)
    logging.getLogger("services.gateway").info(
        "serving %s as %r on http://%s:%d",
        config.model,
        config.served_model_name,
        config.host,
        config.port,
    )
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request on its worker at once.
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
