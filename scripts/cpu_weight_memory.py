"""Resident memory of a loaded CPU engine (SmolLM2, a tiny KV pool): RSS before and after
``LLM(...)`` and its peak, from /proc/self/status. Prints the numbers; nothing is asserted.
Run it from another tree (``PYTHONPATH=<tree>``) to compare revisions.

    .venv/bin/python scripts/cpu_weight_memory.py [--dtype float32]
"""

from __future__ import annotations

import argparse


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    import torch

    from kvscope import engine
    from kvscope.engine import LLM

    torch.set_num_threads(2)
    before = _status_mb("VmRSS")
    llm = LLM("smollm2", device="cpu", dtype=args.dtype, num_gpu_blocks=64)
    after = _status_mb("VmRSS")
    print(f"{engine.__file__}: {args.dtype}, RSS before load {before:.0f} MB, after "
          f"{after:.0f} MB (+{after - before:.0f}), peak {_status_mb('VmHWM'):.0f} MB")
    llm.llm_engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
