"""`python -m gateway`: serve the gateway with uvicorn (settings from the environment)."""

from __future__ import annotations

import logging
import signal
import sys

from gateway.server import GatewayServer, build_config
from gateway.settings import GatewaySettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings()
    print(settings.log_line("gateway"), flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down; after a completed
    # graceful drain that is a clean exit, not death by signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    GatewayServer(build_config(settings)).run()


if __name__ == "__main__":
    main()
