"""`python -m gateway`: serve the gateway with uvicorn (settings from the environment)."""

from __future__ import annotations

import logging

from gateway.server import GatewayServer, build_config
from gateway.settings import GatewaySettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings()
    print(settings.log_line("gateway"), flush=True)
    GatewayServer(build_config(settings)).run()


if __name__ == "__main__":
    main()
