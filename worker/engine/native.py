"""Build and import the engine's C++ CPU kernels (kernels.h: q8_kernels.cpp, row_kernels.cpp,
decode_layers.cpp, bound in kernels_module.cpp), once per version of their sources.

They are one extension (decode_layers.cpp calls the others' kernels directly, without Python in
between). It is compiled on first use with torch's own toolchain helper (a C++ compiler and ninja;
`python -m worker.engine.native` builds them all ahead, as scripts/setup.sh and the worker
image do) into a folder named by a hash of its source, flags and the torch and Python versions,
so a changed kernel is rebuilt and a built one is imported as it is (no compiler, no lock file: a
read-only image works). Where one cannot be built, or the CPU lacks AVX2 and FMA, `load` says
why once and returns None, and the engine keeps torch's own operations for that part.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from worker.engine.cpu_kernels import cpu_flags

log = logging.getLogger(__name__)

# OpenMP: at::parallel_for splits rows over torch's threads (its libgomp); no contraction of a
# product and a sum into one FMA unless written so (row_kernels.cpp repeats torch's roundings)
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
SOURCES = {   # extension name -> its sources (and headers), beside this file
    "llm_stream_cpu_kernels": ("kernels.h", "q8_kernels.cpp", "row_kernels.cpp", "decode_layers.cpp",
                               "kernels_module.cpp"),
}


def _files(name: str) -> list[Path]:
    return [Path(__file__).with_name(file) for file in SOURCES[name]]


def build_directory(name: str) -> Path:
    """Where this extension's build lives: `Q8_KERNELS_DIR` (default: torch's extensions directory,
    `TORCH_EXTENSIONS_DIR` or ~/.cache/torch_extensions), in a folder named by the extension and
    a hash of what it is built from."""
    configured = os.environ.get("Q8_KERNELS_DIR")
    if configured:
        base = Path(configured)
    else:
        from torch.utils.cpp_extension import get_default_build_root
        base = Path(get_default_build_root())
    key = hashlib.sha256(b"".join(path.read_bytes() for path in _files(name))
                         + repr((CFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return base / f"{name}-{key.hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def load(name: str):
    """The compiled extension `name` (a key of SOURCES), or None where it cannot run here
    (logged once with the reason)."""
    if not {"avx2", "fma"} <= cpu_flags():
        log.info("%s: off (this CPU has no AVX2+FMA)", name)
        return None
    directory = build_directory(name)
    try:
        from torch.utils import cpp_extension
        if (directory / f"{name}.so").exists():
            module = cpp_extension._import_module_from_library(name, str(directory), True)
        else:
            directory.mkdir(parents=True, exist_ok=True)
            log.info("%s: compiling into %s (once, ~2 min)", name, directory)
            sources = [str(path) for path in _files(name) if path.suffix == ".cpp"]
            module = cpp_extension.load(name=name, sources=sources, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                        build_directory=str(directory), verbose=False)
    except Exception as error:  # no compiler, no ninja, a read-only cache: torch's operations run instead
        text = str(error).strip()
        log.warning("%s: off (could not build it in %s: %s)", name, directory,
                    text.splitlines()[-1] if text else type(error).__name__)
        return None
    return module


if __name__ == "__main__":   # build ahead of the first worker start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if all(load(name) is not None for name in SOURCES) else 1)
