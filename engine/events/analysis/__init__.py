"""Answers computed from events: request lifecycles and prefix lineage (``lifecycle``),
per-step costs (``costs``), what changed over a range of steps (``ranges``) and the
Perfetto/Chrome trace export (``export``). Torch-free."""
