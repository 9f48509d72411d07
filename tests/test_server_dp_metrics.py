"""The engine's Bregman metrics summed over data-parallel ranks: a real ``bregman-serve
--data-parallel-size 2`` on the tiny model (two engine processes, each writing its own files).

The check itself is `tests.test_server_support.check_engine_metrics_add_up`, which takes a base
URL: a data-parallel fixture elsewhere can call it on its own server instead of starting this
one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .test_server_support import (
    ServerProcess,
    check_engine_metrics_add_up,
    require_tiny_model,
    shut_down,
)

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

MODEL = "models/tiny-llama"


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_tiny_model()
    server = ServerProcess(["--model", MODEL, "--data-parallel-size", "2", "--max-num-seqs", "8",
                            "--enforce-eager"],
                           tmp_path_factory.mktemp("dp-metrics") / "server.log")
    try:
        server.start()
        server.wait_healthy(timeout=480)
        yield server
    finally:
        shut_down(server)


def test_engine_metrics_add_up_over_data_parallel_ranks(data_parallel: ServerProcess) -> None:
    check_engine_metrics_add_up(data_parallel.url, MODEL, engines=2)
