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
