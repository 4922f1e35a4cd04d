"""`pdserve up --routers N` (issue 21, router replicas): N routers, each on its own
ports, every worker registered with each; one `ready` line per router."""

from __future__ import annotations

import pytest

from cluster_helpers import UpProcess, list_workers
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=25)


def test_up_with_two_routers_prints_two_ready_lines_and_both_serve(tmp_path):
    up = UpProcess(["--routers", "2", "--prefill", "0", "--decode", "0", "--mixed", "1", "--num-blocks", "64"],
                   tmp_path / "up.log")
    try:
        _, second, _, second_internal = up._expect("ready", 60).split()
        assert len({up.address, second, up.internal, second_internal}) == 4, up.stdout_lines
        tokens = []
        for public, registry in ((up.address, up.internal), (second, second_internal)):
            assert [w.worker_id for w in list_workers(registry, up.auth)] == ["mixed-0"]
            with Client(public, timeout=60) as client:
                tokens.append(list(collect(client.generate("def f(x):", max_tokens=4, temperature=0.0))[0].token_ids))
        assert tokens[0] == tokens[1] and len(tokens[0]) == 4
    finally:
        assert up.stop() == 0
