"""`python -m gateway`: serve the gateway with uvicorn (settings from the environment)."""

from __future__ import annotations

import logging
import signal
import sys

from gateway.server import GatewayServer, build_config
from gateway.settings import GatewaySettings
from shared.logs import configure


def main() -> None:
    configure("gateway")
    settings = GatewaySettings()
    logging.getLogger("gateway").info(settings.log_line("gateway"))
    # uvicorn re-raises the signal that stopped it once it has shut down; after a completed
    # graceful drain that is a clean exit, not death by signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    GatewayServer(build_config(settings)).run()


if __name__ == "__main__":
    main()
