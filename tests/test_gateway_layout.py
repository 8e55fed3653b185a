"""The gateway's shape (issue 33): both transports' writers implement the one `Writer` the
sender writes to, and only the composition root and the app know the hub."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from gateway.openai.response import OpenAIResponse
from gateway.writer import Writer
from gateway.ws.socket import FrameSocket

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"


@pytest.mark.parametrize("writer", [FrameSocket, OpenAIResponse])
def test_both_transports_implement_the_writer_protocol(writer):
    for name, member in vars(Writer).items():
        if name.startswith("_"):
            continue
        assert callable(getattr(writer, name, None)), f"{writer.__name__} lacks {name}()"
        assert inspect.signature(getattr(writer, name)).parameters.keys() == \
            inspect.signature(member).parameters.keys(), f"{writer.__name__}.{name} differs from Writer's"
    for name in Writer.__annotations__:            # attributes: set by the constructor
        assert re.search(rf"self\.{name}\b[^=\n]*=", inspect.getsource(writer.__init__)), \
            f"{writer.__name__} lacks .{name}"


def test_only_the_composition_root_and_the_app_know_the_hub():
    knowing = set()
    for path in GATEWAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "gateway.hub" or \
                    isinstance(node, ast.Import) and any(a.name == "gateway.hub" for a in node.names) or \
                    isinstance(node, ast.Attribute) and node.attr == "hub":
                knowing.add(path.relative_to(GATEWAY).as_posix())
    assert knowing <= {"hub.py", "app.py"}, knowing
