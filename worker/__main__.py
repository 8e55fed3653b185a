"""`python -m worker`: load the model, then serve requests from Redis until SIGTERM/SIGINT.

SIGTERM is a graceful stop (see worker.service): no new requests, running ones get
`SHUTDOWN_GRACE_S` to finish, the rest are handed back to other workers; exit code 0.
A second signal stops at once (requests still pending are claimed by others after
`CLAIM_IDLE_MS`).
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import logging
import os
import signal
import sys

from shared.config import get_settings
from shared.logs import configure
from worker.engine.model_files import SMOLLM2_GGUF


def dump_stacks() -> None:
    """Every asyncio task's and thread's stack to stdout: a drain that needed a second signal
    is a bug, and this says where it waited."""
    for task in asyncio.all_tasks():
        task.print_stack(limit=12, file=sys.stdout)
    sys.stdout.flush()
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)


def quiet_progress_bars() -> None:
    """No progress bars in a worker: loading a model draws them (transformers' GGUF de-quantizing
    loop uses tqdm directly, huggingface_hub its own), and in a service log they are noise, in a
    JSON log they are lines that are not JSON. Set before the engine imports tqdm (tqdm reads
    TQDM_* once, at import); the engine process inherits them. TQDM_DISABLE= (empty) turns them
    back on."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def openmp_spin_defaults() -> None:
    """OpenMP's idle-thread spin bounded (worker.engine.threads.SPIN_ENV) unless the environment
    sets it: read by libgomp when the engine process (spawned: a fresh interpreter) imports torch."""
    from worker.engine.threads import bound_openmp_spin
    bound_openmp_spin()


def main() -> int:
    # `kill -USR1 <pid>`: every thread's stack to the log, at any moment (a stop that hangs after
    # the event loop ended has no asyncio handler left to ask)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    quiet_progress_bars()
    openmp_spin_defaults()
    settings = get_settings()
    configure("worker")
    logging.getLogger("worker").info(settings.log_line("worker"))
    from worker.engine_process import EngineStartFailed, build_model_engine, start_engine
    from worker.service import WorkerService

    try:
        engine = start_engine(functools.partial(build_model_engine, settings), settings)
    except EngineStartFailed as exc:   # the engine process logged the traceback above
        logging.getLogger("worker").critical("no engine, exiting: %s", exc)
        return 1
    model_name = os.path.basename(settings.model_path.rstrip("/")) if settings.model_path else SMOLLM2_GGUF
    service = WorkerService(settings, engine, model_name=model_name)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        signals = {"count": 0}

        def on_signal(signum: int) -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                logging.getLogger("worker").warning("second signal: exiting now; where the drain was:")
                dump_stacks()
                os._exit(1)
            logging.getLogger("worker").info("signal %d: draining", signum)
            service.request_stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await service.run()

    asyncio.run(serve())
    return 1 if service.fatal else 0


def leave(code: int) -> None:
    """Exit without the interpreter's teardown once the service has stopped cleanly: the drain
    is done, the engine stopped, every request acked or handed back, so nothing is left that a
    finalizer must do. The teardown's last garbage collection could hang with the engine's
    thread and native (torch/OpenMP) objects alive (seen as a worker stuck in `Garbage-collecting`
    after logging its stop), turning a graceful SIGTERM into a SIGKILL."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
