#!/usr/bin/env bash
# Download, HERE, the wheels kvscope's engine needs on the GPU device machine (Python 3.12,
# x86-64, no network there) that its image lacks, into .whl/ (git-ignored), at the
# versions this venv runs. Then check their Requires-Dist (each must be carried or in the
# device image's package list) and that the folder stays well under the 64 MiB that travels.
#
#   bash scripts/gpu_wheels.sh            # then pass carry [".whl"] to the device tool
#
# On the device (docs/GPU.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-24}  # of the 64 MiB a call carries; the tree needs the rest
PY=${PY:-.venv/bin/python}

# What `engine` imports at run time and the device image lacks (KINDS.md's package list),
# with their own missing requirements. typing-extensions is carried because pydantic needs a
# recent one and the image's version is not known ahead.
PACKAGES=(msgspec pyzmq zstandard gguf fastapi starlette uvicorn pydantic pydantic-core
          annotated-types typing-inspection typing-extensions opentelemetry-api)
# In the device image already (KINDS.md, 2026-11-17): requirements that need no wheel.
ON_DEVICE="numpy pyyaml tqdm anyio h11 click httpx idna sniffio annotated-doc requests
           sentencepiece typing-extensions msgpack prometheus-client safetensors tokenizers
           jinja2 matplotlib torch"
# kvscope's own requirements that are deliberately not carried: llguidance is imported only
# by a constrained request, which no section sends.
NOT_CARRIED="llguidance"

version_of() {  # the version this venv runs (pip's normalised name)
  "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'
}

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
specs=()
for name in "${PACKAGES[@]}"; do
  v=$(version_of "$name")
  [[ -n "$v" ]] || { echo "gpu_wheels: $name is not installed in $PY's environment" >&2; exit 1; }
  specs+=("$name==$v")
done
echo "gpu_wheels: downloading ${specs[*]}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${specs[@]}"

# One version of each (two stop the whole install there), and every requirement covered.
"$PY" - "$DEST" "$ON_DEVICE" "$NOT_CARRIED" <<'EOF'
import re, sys, tomllib, zipfile
from pathlib import Path

from packaging.requirements import Requirement

# the device: CPython 3.12 on x86-64 Linux; requirements whose markers fail there don't count
DEVICE = {"python_version": "3.12", "python_full_version": "3.12.3",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
          "platform_machine": "x86_64", "extra": ""}

dest, on_device = Path(sys.argv[1]), set(sys.argv[2].split())
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
carried, needs = {}, {}
for whl in sorted(dest.glob("*.whl")):
    name = norm(whl.name.split("-")[0])
    if name in carried:
        sys.exit(f"gpu_wheels: two wheels of {name}: {carried[name]} and {whl.name}")
    carried[name] = whl.name
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(DEVICE):
                    needs.setdefault(norm(req.name), []).append(name)
# kvscope's own run-time requirements (the base install and the engine extra) count too:
# a missing one fails every section that imports the engine (msgspec once did).
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
not_carried = set(sys.argv[3].split())
for spec in [*project["dependencies"], *project["optional-dependencies"]["engine"]]:
    name = norm(Requirement(spec).name)
    if name not in not_carried:
        needs.setdefault(name, []).append("kvscope")
missing = {r: by for r, by in needs.items() if r not in carried and r not in on_device}
if missing:
    sys.exit(f"gpu_wheels: requirements neither carried nor on the device: {missing}")
print(f"gpu_wheels: {len(carried)} wheels, every requirement carried or on the device")
EOF

size_kib=$(du -sk "$DEST" | cut -f1)
printf 'gpu_wheels: %s holds %.1f MiB\n' "$DEST" "$(echo "$size_kib / 1024" | bc -l)"
ls -1 "$DEST"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "gpu_wheels: over the ${LIMIT_MIB} MiB allowed for wheels" >&2
  exit 1
fi
