"""The documentation stays in step with the code it describes: every setting is in the README's
configuration table, every error code is in docs/protocol.md with its real retryable flag, and
every metric the gateway exports is in docs/operations.md."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from shared.errors import RETRYABLE, ErrorCode

ROOT = Path(__file__).resolve().parent.parent


def test_readme_documents_every_setting():
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", readme))
    missing = [name.upper() for name in GatewaySettings.model_fields if name.upper() not in documented]
    assert not missing, f"README configuration table lacks {missing}"


def test_protocol_doc_lists_every_error_code_with_its_retryable_flag():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (\*\*yes\*\*|no) \|", doc, flags=re.M))
    for code in ErrorCode:
        assert code.value in rows, f"docs/protocol.md lacks error code {code.value}"
        assert (rows[code.value] == "**yes**") == (code in RETRYABLE), f"{code.value}: wrong retryable flag"


def test_operations_doc_lists_every_gateway_metric():
    doc = (ROOT / "docs" / "operations.md").read_text()
    metrics = GatewayMetrics()
    exposition = metrics.render().decode()
    for family in metrics.registry.collect():
        # counters are exposed with a _total suffix; that is the name operators query
        exposed = family.name + "_total" if f"{family.name}_total" in exposition else family.name
        assert f"`{exposed}" in doc, f"docs/operations.md lacks metric {exposed}"
