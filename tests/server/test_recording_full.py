"""A daemon whose recording cannot be written any more (issue 49, defect 7): it goes on
serving and publishing, says so once (a log line, /metrics), and at stop never claims a
recording it did not finish."""

from __future__ import annotations

import httpx

from tests.server.conftest import start_daemon, stop_daemon
from tests.waiting import HANG_S, wait_until

CHAT = "/v1/chat/completions"


def test_recording_that_hits_the_file_limit_stops_alone(tmp_path) -> None:
    record = tmp_path / "run.kvtrace"
    d = start_daemon("--num-gpu-blocks", "96", "--events", "tcp://127.0.0.1:*",
                     record=record, module="tests.server.small_disk_serve",
                     env={"KVSCOPE_TEST_FILE_LIMIT": str(16 << 10)})
    metric = "kvscope:event_recording_failed"
    try:
        assert d.metrics()[metric] == 0.0

        def one_request_then_failed() -> bool:
            r = httpx.post(d.url + CHAT, timeout=HANG_S, json={
                "messages": [{"role": "user", "content": "Count to one hundred."}],
                "max_tokens": 64, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200  # serving goes on, before and after
            return d.metrics()[metric] == 1.0

        wait_until(one_request_then_failed, "the recording reaching the file limit",
                   poll_s=0)
        assert httpx.get(d.url + "/health", timeout=HANG_S).json()["status"] == "ok"
        assert httpx.post(d.url + CHAT, timeout=HANG_S, json={
            "messages": [{"role": "user", "content": "Still there?"}],
            "max_tokens": 4}).status_code == 200
    finally:
        stop_daemon(d)
    out = d.output
    assert d.proc.returncode == 0, out[-3000:]
    assert out.count("recording to ") == 1 and "File too large" in out
    assert "event stream thread failed" not in out and "Traceback" not in out
    assert "recording written to" not in out
    assert f"the recording {record} stopped early" in out
