# syntax=docker/dockerfile:1
# Gateway image: Starlette + uvicorn + redis-py only. No torch, no model, ~150 MB.
# Build: docker build -f deploy/gateway.Dockerfile -t llm-stream-gateway .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY gateway ./gateway
# Core dependencies only (pyproject's worker extra holds torch/transformers); fail the build
# if anything dragged torch in anyway.
RUN pip install . \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM python:${PYTHON_VERSION}-slim
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_HOST=0.0.0.0 GATEWAY_PORT=8000
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# Run from the source tree (static files of the browser page live next to the code).
COPY shared ./shared
COPY gateway ./gateway
# the JS client SDK, which the browser page imports from /clients/js/
COPY clients/js ./clients/js
COPY deploy/healthcheck.py ./healthcheck.py
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "/app/healthcheck.py", "gateway"]
# SIGTERM: the gateway stops accepting, tells every client to reconnect elsewhere (close
# code 1012 + a `shutting_down` error) and exits; compose waits stop_grace_period for it.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "gateway"]
