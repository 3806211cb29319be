"""kvscope: an LLM inference engine whose paged KV cache you can see.

The one import package kvscope installs. The repository keeps its rooms as top-level
folders and setup.py maps them here: ``kvscope.engine`` (the engine, the event protocol,
the daemon and the plugins), ``kvscope.inspector`` (the Qt app), ``kvscope.kernels``
(Triton and C kernels beside their references). This file lives in ``assets/`` because
the data files (the sample recording, workload definitions) are this package's data, read
with ``importlib.resources.files("kvscope")``. It imports nothing: ``import kvscope``
stays free."""
