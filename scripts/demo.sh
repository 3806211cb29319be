#!/usr/bin/env bash
# `make demo`: kvscope serving a real workload while the inspector draws its KV cache.
#
# 1. `kvscope serve` on the embedded default model, events on, recording to
#    demo-out/demo.kvtrace, a small KV pool (so preemption and eviction happen) with
#    prefix caching; quantized pages and the CPU swap tier when this build has them.
# 2. `kvscope load --workload demo`: bursts of chats sharing a system prompt, plus
#    document questions with long shared prefixes.
# 3. With a display: the inspector attached live (`kvscope inspect --connect ...`);
#    closing its window or Ctrl-C stops everything. Without one (DISPLAY unset, not
#    macOS): run for DEMO_SECONDS (default 60) in all, then write demo-out/demo.png from
#    the recording and say how to open both.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
OUT=demo-out
DEMO_SECONDS=${DEMO_SECONDS:-60}
START=$SECONDS
mkdir -p "$OUT"
rm -f "$OUT/demo.kvtrace" "$OUT/demo.png"

headless=1
if [[ -n "${DISPLAY:-}" || -n "${WAYLAND_DISPLAY:-}" || "$(uname)" == Darwin ]]; then
  headless=0
fi
[[ "${DEMO_HEADLESS:-}" == 1 ]] && headless=1

# Free loopback ports: one for HTTP, a pair (p, p+1) for events and snapshots.
read -r HTTP_PORT EV_PORT < <($PY - <<'EOF'
import socket
def free(pair=False):
    while True:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
        if not pair:
            return p
        try:
            t = socket.socket(); t.bind(("127.0.0.1", p + 1)); t.close(); return p
        except OSError:
            continue
print(free(), free(pair=True))
EOF
)
URL="http://127.0.0.1:$HTTP_PORT"
EVENTS="tcp://127.0.0.1:$EV_PORT"

SERVER_PID=""
LOAD_PID=""
cleanup() {
  trap - EXIT INT TERM
  [[ -n "$LOAD_PID" ]] && kill -INT "$LOAD_PID" 2>/dev/null || true
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true   # drains, then closes the recording
    for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

# A small pool: 64 blocks x 8 tokens = 512 KV tokens for up to 8 sequences of ~80-220
# tokens, so the batch outgrows the pool (preemption) and cached prefixes get evicted.
BASE=(--model smollm2 --port "$HTTP_PORT" --events "$EVENTS" --record "$OUT/demo.kvtrace"
      --num-gpu-blocks 64 --block-size 8 --max-num-seqs 8 --max-model-len 2048
      --enable-prefix-caching --drain-timeout 5 --log-level warning)
# Features still being built raise a clear error at start-up: try the richest set first.
VARIANTS=("--kv-cache-dtype int8 --preemption-mode swap --swap-space 0.05"
          "--kv-cache-dtype int8"
          "--preemption-mode swap --swap-space 0.05"
          "")

start_server() {  # $1: extra flags; returns 0 once ready
  rm -f "$OUT/demo.kvtrace"
  # shellcheck disable=SC2086
  $PY -m kvscope.engine.cli serve "${BASE[@]}" $1 >"$OUT/serve.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1200); do
    grep -q "ready on" "$OUT/serve.log" && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { wait "$SERVER_PID" 2>/dev/null || true; return 1; }
    sleep 0.1
  done
  echo "demo: the server did not start in 120 s; see $OUT/serve.log" >&2
  exit 1
}

echo "demo: starting kvscope serve (model load takes a few seconds)..."
FEATURES=""
for extra in "${VARIANTS[@]}"; do
  if start_server "$extra"; then FEATURES="$extra"; break; fi
  if [[ -z "$extra" ]]; then
    echo "demo: kvscope serve failed:" >&2; cat "$OUT/serve.log" >&2; exit 1
  fi
  echo "demo: this build refuses '$extra' ($(tail -n 1 "$OUT/serve.log")); trying less"
done
SERVER_PID_SHOWN=$SERVER_PID
cat "$OUT/serve.log"
echo "demo: server ready after $(( SECONDS - START )) s"
echo "demo: extra engine features on: ${FEATURES:-none (fp32 pages, recompute preemption)}"

if [[ $headless == 0 ]]; then
  echo "demo: workload running; the inspector opens attached to $EVENTS"
  echo "demo: close the inspector window or press Ctrl-C to stop everything"
  $PY -m kvscope.engine.cli load --url "$URL" --workload demo --duration 86400 --no-progress \
    >"$OUT/load.txt" 2>&1 &
  LOAD_PID=$!
  $PY -m kvscope.engine.cli inspect --connect "$EVENTS" || true
  echo "demo: inspector closed; stopping (recording: $OUT/demo.kvtrace)"
  exit 0
fi

# Headless: the demo takes about DEMO_SECONDS in all: the workload runs until ~18 s
# before the end (at least 20 s, so a slow model load can stretch the total), then the
# stragglers are cancelled (3 s), the server drains, the screenshot is rendered.
LOAD_S=$(( DEMO_SECONDS - (SECONDS - START) - 18 ))
(( LOAD_S < 20 )) && LOAD_S=20
echo "demo: headless (no DISPLAY): running the 'demo' workload for $LOAD_S s against $URL"
# --max-wait: requests still running 3 s after the end are cancelled (the server aborts
# them, which the recording shows too).
$PY -m kvscope.engine.cli load --url "$URL" --workload demo --duration "$LOAD_S" --max-wait 3 \
  --no-progress | tee "$OUT/load.txt" || true
echo "demo: stopping the server (drain, then the recording is closed)"
kill -TERM "$SERVER_PID_SHOWN"
wait "$SERVER_PID_SHOWN" || true
SERVER_PID=""
tail -n 2 "$OUT/serve.log"

# Screenshot the busiest moment: the step with the most KV blocks in use.
STEP=$($PY - "$OUT/demo.kvtrace" <<'EOF'
import sys
from kvscope.engine.events.wire.recording import Recording
rec = Recording(sys.argv[1])
best, used = rec.steps[-1], -1
for b in rec:
    u = b["stats"].get("tiers", {}).get("gpu", {}).get("used", 0) + len(b["events"]) * 1e-6
    if u > used:
        best, used = b["step"], u
print(best)
EOF
)
QT_QPA_PLATFORM=offscreen $PY -m kvscope.engine.cli inspect "$OUT/demo.kvtrace" --step "$STEP" \
  --screenshot "$OUT/demo.png"
echo
echo "demo: done in $(( SECONDS - START )) s."
echo "  recording:  $OUT/demo.kvtrace   (replay: .venv/bin/kvscope inspect $OUT/demo.kvtrace)"
echo "  screenshot: $OUT/demo.png      (step $STEP, the most KV blocks in use)"
echo "  server log: $OUT/serve.log, workload summary: $OUT/load.txt"
