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

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker, and every engine it starts, keeps to its share of the cores. vLLM's CPU
    # worker otherwise binds its OpenMP threads to the same cores from every worker, and
    # spinning OpenMP teams on shared cores ran torch-heavy tests beside an engine up to 20x
    # slower (tests/test_exact_search.py beside tests/test_processor.py: 96 s -> 40 s).
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
