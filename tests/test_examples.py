"""Every example under examples/ runs and exits 0 against a real broker (typer's test_tutorial).

Examples are discovered by glob, so a new file is covered without touching this test.
Each runs as a subprocess, from the repository root as the README shows, with
RABBIT_DELAY_URL pointing at the test broker and RABBIT_DELAY_EXAMPLE_NAMESPACE set to a
namespace of its own, so parallel runs never consume each other's messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 90

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def test_examples_exist() -> None:
    assert any(p.name == "demo.py" for p in EXAMPLES), (
        "examples/demo.py (the README's first command) is missing"
    )


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_exits_zero(example: Path, broker_url: str) -> None:
    env = {
        **os.environ,
        "RABBIT_DELAY_URL": broker_url,
        "RABBIT_DELAY_EXAMPLE_NAMESPACE": "ex" + uuid.uuid4().hex[:10],
        "PYTHONUNBUFFERED": "1",
    }
    try:
        proc = subprocess.run(
            [sys.executable, str(example)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        so_far = "".join(_text(part) for part in (exc.stdout, exc.stderr))
        pytest.fail(f"{example.name} did not finish within {TIMEOUT_S}s; output so far:\n{so_far}")
    assert proc.returncode == 0, (
        f"{example.name} exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
