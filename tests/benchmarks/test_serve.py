"""benchmarks/serve.py launches `strata serve` (the bundled model), loads it and reports its fields."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from benchmark_scripts import run_benchmark


def test_serve_launches_a_server_and_reports_latencies(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--launch", "--url", f"http://127.0.0.1:{port}", "--concurrency", "2", "--num-requests", "4"]
    args += ["--max-tokens", "4", "--json-out", str(tmp_path / "r.json")]
    # A small KV cache, and no C++ kernels to build: the harness, not the server's speed, is under test.
    env = {"STRATA_DISABLE_CPU_KERNELS": "1", "STRATA_KV_CACHE_MEMORY": str(2**24)}
    report, table = run_benchmark("serve", *args, env=env)

    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert (report["concurrency"], report["num_requests"], report["max_tokens"]) == (2, 4, 4)
    assert report["output_tokens"] == 16 and report["requests_per_s"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}
    assert "requests/s" in table


def test_mixed_load_checks_every_reply_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Every kind of request of the mixed load runs against a launched server: no failure, no 5xx, each
    disconnect aborted, and nothing left running or holding KV blocks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--launch", "--url", f"http://127.0.0.1:{port}", "--scenario", "mixed", "--concurrency", "6"]
    args += ["--num-requests", "27", "--max-tokens", "12"]
    env = {"STRATA_DISABLE_CPU_KERNELS": "1", "STRATA_KV_CACHE_MEMORY": str(2**24)}
    report, table = run_benchmark("serve", *args, env=env)

    assert report["failures"] == 0 and report["server_errors_5xx"] == 0, report["first_errors"]
    assert all(outcome["sent"] == 3 for outcome in report["by_kind"].values())
    disconnects = sum(report["by_kind"][kind]["sent"] for kind in ("disconnect_stream", "disconnect_whole"))
    assert report["server_counted"] == {"http_5xx": 0, "requests_aborted": disconnects}
    assert report["after"] == {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    assert report["requests_completed"] == 27 - disconnects and report["output_tokens"] > 0
    assert "requests aborted" in table
