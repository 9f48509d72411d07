"""Session-wide pytest hooks."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

if not torch.cuda.is_available():
    # The Triton kernels' tests (tests/test_kernels.py) run them on CPU tensors under Triton's
    # interpreter, which Triton reads when it is first imported (vLLM imports it): set before
    # any test module is collected. On a GPU they run on the device.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The reliability suite's figures (tests/test_reliability.py), when it ran."""
    module = sys.modules.get("tests.test_reliability")
    figures = getattr(module, "FIGURES", None)
    if figures and figures["requests"]:
        terminalreporter.write_line(f"reliability figures: {json.dumps(figures)}")
    # The router's and data parallelism's (tests/test_router.py, tests/test_data_parallel.py).
    for name in ("router", "data_parallel"):
        figures = getattr(sys.modules.get(f"tests.test_{name}"), "FIGURES", None)
        if figures:
            terminalreporter.write_line(f"{name.replace('_', ' ')} figures: "
                                        f"{json.dumps(figures)}")
