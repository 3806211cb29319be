"""The router in front of two real `kvscope serve` replicas: prefix-aware routing with
predictions that match the replicas' own cached_tokens, streaming passed through, and a
replica killed mid-request (its request fails cleanly, the other keeps serving, it
rejoins after a restart under a new epoch)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from kvscope.engine.loadgen.summary import parse_metrics
from tests.router.conftest import Cluster, launch_replica, wait_ready
from tests.waiting import HANG_S

pytestmark = pytest.mark.slow

SYSTEM = ("You are a patient tutor who explains computer science ideas with short, "
          "concrete examples, and who always checks that the student has understood "
          "before moving on to the next idea in the lesson.")


def _chat(question: str, **extra: object) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0.0, **extra}


def test_prefix_routing_predicts_the_replicas_cache(cluster: Cluster) -> None:
    url = cluster.router.url
    first = httpx.post(url + "/v1/chat/completions", json=_chat("What is a hash table?"),
                       timeout=HANG_S)
    assert first.status_code == 200, first.text
    home = first.headers["x-kvscope-replica"]
    # wait until the stored blocks reached the router through the event stream
    cluster.wait_for(lambda st: st["replicas"][cluster.replica_index(home)]["cached_blocks"]
                     >= 3)
    lines = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=HANG_S,
                      json=_chat("What is a linked list?", stream=True,
                                 stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["x-kvscope-replica"] == home  # the shared system prompt lives there
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32
    m = httpx.get(url + "/metrics", timeout=HANG_S).text
    assert f'kvscope:router_decisions_total{{reason="prefix",replica="{home}"}} 1.0' in m
    values = parse_metrics(m)
    assert values["kvscope:router_actual_cached_tokens_total"] == \
        usage["prompt_tokens_details"]["cached_tokens"]
    # the prediction from the event stream is exactly what the replica then served
    assert values["kvscope:router_predicted_cached_tokens_total"] == \
        values["kvscope:router_actual_cached_tokens_total"]
    # a Responses API request with the same instructions goes home too, as predicted
    resp = httpx.post(url + "/v1/responses", timeout=HANG_S, json={
        "instructions": SYSTEM, "input": "What is a queue?", "max_output_tokens": 4,
        "temperature": 0.0})
    assert resp.status_code == 200 and resp.headers["x-kvscope-replica"] == home, resp.text
    assert resp.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 32
    values = parse_metrics(httpx.get(url + "/metrics", timeout=HANG_S).text)
    assert values["kvscope:router_predicted_cached_tokens_total"] == \
        values["kvscope:router_actual_cached_tokens_total"]
    # the API is the replicas' own: errors pass through unchanged
    bad = httpx.post(url + "/v1/chat/completions", json={"messages": [], "max_tokens": 1},
                     timeout=HANG_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert httpx.get(url + "/v1/models", timeout=HANG_S).json()["data"][0]["id"] == "smollm2"


def test_fleet_view_of_the_routers_replicas(cluster: Cluster, qapp) -> None:  # noqa: ANN001
    """`kvscope inspect --connect http://ROUTER`: a panel per replica, live from its event
    stream, with the router's per-replica figures."""
    import time

    from kvscope.inspector.fleet import _build

    win = _build([], [cluster.router.url])

    def caught_up(st: list[dict]) -> bool:
        """Every panel shows its replica's routing and the cache the router indexes."""
        return win.has_state and len(win.panels) == len(st) and all(
            f"{rep['routed']} routed" in panel.router_line.text()
            and sum(len(t.hashes) for t in panel.model.state.tiers.values())
            == rep["cached_blocks"] for panel, rep in zip(win.panels, st, strict=True))

    try:
        win.start()
        end = time.monotonic() + HANG_S
        while True:  # the window's 30 Hz ticks hand the streams' frames to the models
            qapp.processEvents()
            win.fetch_router_now()
            st = cluster.status()["replicas"]
            if caught_up(st) or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert win.has_state and len(win.panels) == 2
        for panel, rep in zip(win.panels, st, strict=True):
            assert panel.key == rep["url"]
            assert f"{rep['routed']} routed" in panel.router_line.text()
            assert "in rotation" in panel.router_line.text()
            assert "prefix hits" in panel.header.text()
            # the panel draws the same cache the router indexes
            assert sum(len(t.hashes) for t in panel.model.state.tiers.values()) == \
                rep["cached_blocks"]
    finally:
        win.stop()
        win.close()


def test_tokenize_and_detokenize_pass_through(cluster: Cluster) -> None:
    body = {"messages": _chat("What is a hash table?")["messages"]}
    via_router = httpx.post(cluster.router.url + "/tokenize", json=body, timeout=HANG_S)
    direct = httpx.post(cluster.specs[0].url + "/tokenize", json=body, timeout=HANG_S)
    assert via_router.status_code == direct.status_code == 200, via_router.text
    assert via_router.json() == direct.json()
    ids = direct.json()["tokens"]
    back = httpx.post(cluster.router.url + "/detokenize", json={"tokens": ids}, timeout=HANG_S)
    assert back.status_code == 200 and "hash table" in back.json()["prompt"]
    bad = httpx.post(cluster.router.url + "/detokenize", json={"tokens": [-1]}, timeout=HANG_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_killed_replica_fails_its_requests_and_rejoins(cluster: Cluster) -> None:
    url = cluster.router.url
    body = {"prompt": "Count slowly from one to one hundred:", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200
        victim = r.headers["x-kvscope-replica"]
        k = cluster.replica_index(victim)
        survivor = f"r{1 - k}"
        it = r.iter_lines()
        assert next(ln for ln in it if ln.startswith("data: ")).startswith("data: {")
        # meanwhile the other replica serves someone else to completion
        other: list[httpx.Response] = []
        t = threading.Thread(target=lambda: other.append(httpx.post(
            url + "/v1/completions", timeout=HANG_S,
            json={"prompt": "Hello", "max_tokens": 24, "ignore_eos": True})))
        t.start()
        cluster.replicas[k].stop(signal.SIGKILL)  # a crash, not a drain
        rest = [ln for ln in it if ln.startswith("data: ")]
        t.join(HANG_S)
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "replica_failed" and victim in err["message"]
    assert other and other[0].status_code == 200, other
    assert other[0].headers["x-kvscope-replica"] == survivor
    st = cluster.wait_for(lambda st: not st["replicas"][k]["in_rotation"])
    assert not st["replicas"][k]["in_rotation"] and st["replicas"][k]["failed"] == 1
    for _ in range(3):  # everything goes to the survivor now
        r2 = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                        timeout=HANG_S)
        assert r2.status_code == 200 and r2.headers["x-kvscope-replica"] == survivor
    assert httpx.get(url + "/health", timeout=HANG_S).json()["in_rotation"] == [survivor]
    # restart it on the same ports: a new epoch, a fresh index, back in rotation
    old_epoch = st["replicas"][k]["epoch"]
    cluster.replicas[k] = wait_ready(*launch_replica(cluster.specs[k]))
    st = cluster.wait_for(lambda st: st["replicas"][k]["in_rotation"] and
                          st["replicas"][k]["epoch"] not in (None, old_epoch))
    rep = st["replicas"][k]
    assert rep["in_rotation"] and rep["restarts"] == 1 and rep["cached_blocks"] == 0
    served = {httpx.post(url + "/v1/completions", timeout=HANG_S,
                         json={"prompt": f"Say {w}", "max_tokens": 2}).headers[
        "x-kvscope-replica"] for w in ("one", "two", "three", "four")}
    assert served == {"r0", "r1"}
