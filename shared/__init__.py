"""Code shared by the gateway and the worker: settings, wire protocol, Redis stream layout."""
