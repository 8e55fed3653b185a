"""The Helm chart (deploy/helm/llm-stream) as the real `helm` renders it, for the chart's tests
(tests/test_helm_chart.py) and the rolling-upgrade test, which takes its pods' settings and
grace periods from it. scripts/setup.sh installs helm (scripts/install-helm.sh)."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "llm-stream"
VALUES_FILES = ["default", *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
NAMESPACE = "llm"
RELEASE = "llm"


def helm_binary() -> str:
    """The helm of this venv (scripts/setup.sh puts it next to python), else one on PATH. Its
    absence fails: these tests stand for the chart, so setup must install it."""
    for candidate in (Path(sys.executable).parent / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("no helm: run scripts/setup.sh (scripts/install-helm.sh installs it into .venv/bin)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def values_args(values_file: str, extra: tuple[str, ...] = ()) -> list[str]:
    return ([] if values_file == "default" else ["-f", str(CHART / "ci" / values_file)]) + list(extra)


@functools.lru_cache(maxsize=None)
def render(values_file: str = "default", *extra: str) -> tuple[dict, ...]:
    """The manifests `helm template` renders (deep copies are the callers' business)."""
    proc = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(values_file, extra))
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def manifests(values_file: str = "default", *extra: str) -> list[dict]:
    return copy.deepcopy(list(render(values_file, *extra)))


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{len(found)} {kind} named *{name_suffix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def containers(doc: dict, init: bool = False) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}
