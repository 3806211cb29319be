"""``kvscope load``: named, seeded workloads driven against an OpenAI-compatible server."""
