"""The benchmark scripts run, and the side-by-side baseline really loads another core.

Timings are not checked here (they belong to `benchmarks/`); this runs the core benchmark at
its smallest sizes so that a broken script, or a ``--baseline`` that silently resolves to the
current core (which would print new/old ratios of 1 and hide a regression), fails the suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_git_history() -> bool:
    if shutil.which("git") is None:
        return False
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "HEAD"],
                          capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _has_git_history(), reason="needs the git checkout (not a source copy)")
def test_core_benchmark_runs_side_by_side_with_a_baseline_core():
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_core.py", "--quick", "--only", "ratios",
         "--baseline", "HEAD"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    baseline_rows = [line for line in lines if "baseline: " in line and "new/old" in line]
    # Every Bregman case of both tables has its baseline twin: 7 typical cases per shape
    # (2 batch sizes x 1 vocabulary) and 5 worst cases.
    assert len(baseline_rows) == 7 * 2 + 5, done.stdout
    assert "the core of HEAD" in done.stdout


def test_baseline_loader_imports_the_other_tree(tmp_path, monkeypatch):
    """`load_baseline` returns the baseline's own function, never the current one."""
    if not _has_git_history():
        pytest.skip("needs the git checkout (not a source copy)")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_core

    from bregman_vllm import bregman_decode

    decode = bench_core.load_baseline("HEAD")
    assert decode is not bregman_decode
    assert decode.__module__ in (bench_core.BASELINE_PACKAGE + ".decode",
                                 bench_core.BASELINE_PACKAGE + ".core.decode")


@pytest.mark.skipif(not _has_git_history(), reason="needs the git checkout (not a source copy)")
def test_extreme_parameter_table_runs_and_every_case_decodes_to_a_distribution():
    """`bench_core.py --only extremes` (issue 18): every end of every range is decoded to a
    finite distribution (the table's ``finite`` column: no NaN, no inf, normalized), the refused
    values are refused, the old core runs beside it, and the counted work of every case
    (elements and launched ops, `DispatchCounter`; load-independent, unlike its times) is at
    most the stated multiple ``WORK_BOUND`` of the default configuration's on the same rows."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_core.py", "--quick", "--only", "extremes",
         "--baseline", "HEAD"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_core
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lines = done.stdout.splitlines()
    for name in bench_core.EXTREMES:
        rows = [line for line in lines if line[:36].rstrip() == name]
        assert len(rows) == 2, name  # realistic and flat rows
        for row in rows:
            _, _, elements, launches, finite = row[36:].split()[:5]
            assert finite == "yes", row
            assert float(elements) <= bench_core.WORK_BOUND, row
            assert float(launches) <= bench_core.WORK_BOUND, row
    assert "bound M = " in done.stdout
    # (HEAD's core is this one: every output the same, bit for bit, in both tables)
    same = re.findall(r"outputs bit-identical to the old core's: (\d+) of (\d+) cases",
                      done.stdout)
    assert len(same) == 2 and all(a == b and int(b) > 0 for a, b in same), same
    for name in bench_core.REFUSED:
        rows = [line for line in lines if line[:36].rstrip() == name]
        assert len(rows) == 2 and all("refused (400)" in row for row in rows), rows


def test_parameter_sweep_stays_within_the_stated_bound():
    """`bench_core.py --only sweep` (issue 18, part 3): alphas across both modes' ranges, each
    with lambdas that put k* anywhere from a few tokens to the whole row, on flat and peaked
    rows; every call decodes to a distribution (the script raises otherwise) and its counted
    work (elements and launched ops) is within ``WORK_BOUND`` of the default configuration's.
    (`--quick`: [4, 4096], every third alpha and lambda; the full sweep's figures are in
    docs/benchmarks.md.)"""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_core.py", "--quick", "--only", "sweep"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_core
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [line.split() for line in done.stdout.splitlines()
            if line.split()[:1] in (["peaked"], ["flat"])]
    assert len(rows) == 2 * sum(len(alphas[1::3]) for alphas in bench_core.SWEEP_ALPHAS.values())
    for row in rows:
        assert float(row[4]) <= bench_core.WORK_BOUND and float(row[5]) <= bench_core.WORK_BOUND
    # the sweep reaches the costly regime: k* in the thousands on some row of either kind
    assert max(int(row[6]) for row in rows) > 1000
    assert "bound M = " in done.stdout


def test_triton_benchmark_runs_at_tiny_shapes():
    """`bench_triton.py --smoke` (the GPU run's script, issue 24) at tiny shapes on the CPU under
    Triton's interpreter: every section runs, every family agrees with the float64 torch step,
    the bounded configurations are four kernel launches and no sync, the search's six, the
    wide pass's seven and its sort."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_triton.py", "--smoke"], cwd=ROOT,
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    total = next(line for line in out.splitlines() if line.strip().startswith("in all:"))
    same, rows = total.split()[2].split("/")
    assert same == rows and int(rows) >= 14 * 3, total
    assert "<- differs" not in out
    for name, launches in (("primal a=3 lam=1e-3 k_max=50", "4 + 0"), ("top_k=50 a=3", "4 + 0"),
                           ("keep all (lam=0)", "4 + 0"), ("dual a=4 lam=1e-3 (search)", "6 + 0"),
                           # (k_max 1024 passes the interpreter's widest search, 512: the
                           # wide pass here; on a GPU the search's 1024 candidates hold it)
                           ("primal a=1.5 lam=1e-6 k_max=1024 (search)", "7 + 1"),
                           ("dual a=4 lam=1e-30 (wide)", "7 + 1")):
        line = next(line for line in out.splitlines() if line.strip().startswith(name)
                    and "launches" in line)
        assert line.split("launches")[1].split(",")[0].strip() == launches, line
        assert line.endswith("syncs 0"), line
    for section in ("warm-up:", "one in-place step", "flat worst cases", "recompiles:"):
        assert section in out, section


def test_every_kernel_compiles_for_a_gpu_without_spills():
    """`bench_triton.py --only compile`: the real Triton compiler (not the interpreter, which
    checks no types) builds every kernel a processor's warm-up builds, at the 64-candidate
    widths and the wide pass's kernel, for an H100 (sm_90) with no GPU here, from an empty
    cache; and none spills registers to local memory. A kernel that compiles only under the
    interpreter would fail the warm-up on every GPU (the processor then falls back to the
    torch step)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_triton.py", "--only", "compile", "--vocab", "4096",
         "--widths", "64", "4096"], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=env)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    lines = [line for line in done.stdout.splitlines() if "registers" in line]
    labels = [re.match(r"\s*(\S+(?: [KCV]=\d+)?)\s", line).group(1) for line in lines]
    assert labels == ["read", "select K=64", "decode K=64", "write K=64", "select C=64",
                      "search C=64", "wide V=4096"], done.stdout
    for line in lines:
        assert line.endswith("local memory 0 bytes"), line


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_the_gpu_runs_exact_stage_runs_on_a_cpu(tmp_path):
    """`benchmarks/gpu_run.sh exact` (issue 25's GPU run, for a session lent a GPU) runs its
    stages to the end here with ``DEVICE=cpu SMALL=1``: both tables printed, every stage exit 0,
    the log written under ``$OUT``; an unknown run is refused with status 2. The floor table
    (`bench_core.py --only floor`) has a row per worst case, each map solved at the call's own
    k* (a size of the row) and every figure a positive number."""
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "SMALL": "1",
           "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_run.sh", "exact"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "gpu_run_exact.log").read_text()
    assert log.count("(exit 0)") == 2, log[-3000:]
    assert "the exact path's floor at [4, 4096]" in log
    rows = [line.split() for line in log.splitlines()
            if line.startswith(("realistic dual", "flat dual"))]
    assert len(rows) == 5, log
    for row in rows:
        k_star, *figures = row[4:]  # (after the case's name: 4 words)
        assert 1 <= int(k_star) <= 4096 and len(figures) == 6 + 2, row  # 2 caps by default
        assert all(float(figure) > 0 for figure in figures), row
    assert "worst multiple of a sort of the same rows" in log
    refused = subprocess.run(["bash", "benchmarks/gpu_run.sh", "everything"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "usage" in refused.stderr
    assert not (tmp_path / "gpu_run_everything.log").exists()
