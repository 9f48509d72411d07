"""Session-wide pytest hooks: the figures some modules collect, printed once at the end.

`make test` runs the suite on two pytest-xdist workers (``-n 2 --dist loadfile``: a module's
tests, and the servers its fixtures share, stay on one worker). The figures are kept in module
globals named ``FIGURES`` by the module that collects them; each worker hands its modules'
figures to the controller (``workeroutput``), which prints them with the summary. Without
xdist the same modules are read in the one process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels' tests (tests/test_kernels.py) run them on CPU tensors under Triton's
    # interpreter, which Triton reads when it is first imported (vLLM imports it): set before
    # any test module is collected. On a GPU they run on the device.
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Modules with figures, and the label of each in the summary.
_FIGURE_MODULES = {"reliability": "reliability", "router": "router",
                   "data_parallel": "data parallel"}
_collected: dict[str, Any] = {}


def _local_figures() -> dict[str, Any]:
    figures = {}
    for name in _FIGURE_MODULES:
        found = getattr(sys.modules.get(f"tests.test_{name}"), "FIGURES", None)
        # The reliability figures count requests: only worth showing once some were sent.
        if found and (name != "reliability" or found.get("requests")):
            figures[name] = found
    return figures


def pytest_sessionfinish(session: Any) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand them to the controller
        workeroutput["figures"] = json.dumps(_local_figures())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: a worker finished; keep its figures."""
    _collected.update(json.loads(getattr(node, "workeroutput", {}).get("figures", "{}")))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for name, figures in {**_local_figures(), **_collected}.items():
        terminalreporter.write_line(f"{_FIGURE_MODULES[name]} figures: {json.dumps(figures)}")
