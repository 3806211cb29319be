"""Tiny random models written by the tests themselves: HF directories saved by transformers,
and GGUF files laid out the way llama.cpp writes them (Q/K rows permuted for its rope)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=272, max_position_embeddings=256)


def tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of `kind` ("llama", "qwen2", "mistral", "qwen3", "phi3")
    in float32, eval."""
    import transformers

    torch.manual_seed(seed)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]
    extra = {"sliding_window": None} if kind in ("mistral", "phi3") else {}
    if kind == "phi3":  # its defaults name token 32000, past the tiny vocabulary
        extra |= {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}
    if kind == "gemma3_text":  # five windowed layers, then a global one (and one more)
        extra = {"num_hidden_layers": 7, "head_dim": 16, "sliding_window": 16,
                 "query_pre_attn_scalar": 24, "pad_token_id": 0, "bos_token_id": 2,
                 "eos_token_id": 1,
                 "rope_parameters": {
                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                        "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    if kind == "qwen3":
        extra = {"head_dim": 24}  # not hidden / heads, as in the real Qwen3 configs
    config = config_cls(**(TINY | extra | overrides))
    model = model_cls(config).to(torch.float32).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so they are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute of Q/K rows (the inverse of what we undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def byte_tokens() -> list[str]:
    from kvscope.engine.model.tokenizer import _bytes_to_unicode

    return list(_bytes_to_unicode().values())


SPM_CORPUS = ["the quick brown fox jumps over the lazy dog", "kvscope pages the cache of a model",
              "numbers 1234 5678 and 90, 3.14", "café naïve déjà vu", "hello world, hello there",
              "  two spaces and tabs\tthen\nnew lines"]


def spm_vocab(arch: str = "llama", pieces: int = 90) -> dict:
    """A SentencePiece BPE vocabulary laid out as llama.cpp's converter writes one: special
    tokens, the 256 ``<0xAB>`` byte tokens, then the learned pieces in merge order (score -i)
    and the single characters after them. Learned here with ``tokenizers``' BPE trainer on
    words marked with U+2581, as SentencePiece learns them. Gemma's layout (``arch`` "gemma3")
    puts pad/eos/bos/unk first, adds its turn markers, and a run of spaces as a user-defined
    token spelled with real spaces, as Gemma's files have them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    learner.train_from_iterator(SPM_CORPUS * 3, trainers.BpeTrainer(vocab_size=200,
                                                                     show_progress=False))
    vocab = learner.get_vocab()
    merged = [a + b for a, b in (m.split(" ") if isinstance(m, str) else m
                                 for m in _merges_of(learner))][:pieces]
    chars = sorted((t for t in vocab if len(t) == 1), key=vocab.get)
    if arch == "gemma3":
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2),
                ("<start_of_turn>", 3), ("<end_of_turn>", 3), ("  ", 4)]
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<|user|>", 3), ("<|end|>", 3)]
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + merged + chars
    types = [ty for _, ty in head] + [6] * 256 + [1] * (len(merged) + len(chars))
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(merged) + len(chars))]
    return {"tokens": tokens, "scores": scores, "types": types}


def _merges_of(learner) -> list:
    import json

    return json.loads(learner.to_str())["model"]["merges"]


def write_spm_tokenizer(writer, arch: str = "llama") -> dict:
    """Write `spm_vocab(arch)` as llama.cpp's converter writes a SentencePiece tokenizer;
    returns the vocabulary."""
    vocab = spm_vocab(arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    gemma = arch == "gemma3"
    writer.add_bos_token_id(2 if gemma else 1)
    writer.add_eos_token_id(1 if gemma else 2)
    writer.add_unk_token_id(3 if gemma else 0)
    if gemma:  # Gemma has no dummy prefix; Llama's files leave the key out (default: on)
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    return vocab


def write_tiny_gguf(model, path: Path, arch: str = "llama", qtype: str = "F32",
                    drop: tuple[str, ...] = (), tie: bool = True, spm: bool = False) -> Path:
    """Write `model` (a tiny HF Llama, Qwen2/3 or Gemma 3 text) as a GGUF file of llama.cpp's
    `arch`. `drop` omits GGUF tensors by name; `qtype` ("F32" | "F16") is used for the 2-D
    weight matrices; `spm` writes a SentencePiece tokenizer (write_spm_tokenizer) instead of
    the byte-level one."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "gemma3" or head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    gemma = arch == "gemma3"
    rope_factors: dict[str, np.ndarray] = {}  # Phi-3's LongRoPE factors, as tensors
    rope = cfg.rope_parameters
    if gemma:  # as llama.cpp's converter: the global layers' base and scaling, the local base
        rope = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]
                                            ["rope_theta"]))
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        # GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim (but for the 27B)
        assert cfg.query_pre_attn_scalar == head_dim, "not expressible in a gemma3 GGUF"
    if arch == "phi3":  # as llama.cpp's converter: rotated dims, window 0 for none, LongRoPE
        rotary = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) \
            // cfg.num_attention_heads
        writer.add_rope_dimension_count(rotary)
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = rope.get("original_max_position_embeddings",
                            cfg.original_max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            rope_factors = {f"rope_factors_{kind}.weight":
                            np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
                            for kind in ("long", "short")}
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if spm:
        write_spm_tokenizer(writer, arch)
    else:
        _write_byte_level_tokenizer(writer, cfg.vocab_size)
    _write_tensors(writer, model, cfg, arch, qtype, drop, tie, rope_factors)
    return path


def _write_byte_level_tokenizer(writer, vocab_size: int) -> None:
    tokens = byte_tokens() + ["<|im_start|>", "<|im_end|>", "Ġt"]
    tokens += [f"Ġt{i}" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3] + [1] * (len(tokens) - 258))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                             "{% endfor %}")


def _write_tensors(writer, model, cfg, arch: str, qtype: str, drop: tuple[str, ...],
                   tie: bool, rope_factors: dict[str, np.ndarray]) -> None:
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    gemma = arch == "gemma3"

    def add(name: str, array: np.ndarray) -> None:
        if name in drop:
            return
        if gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w
            array = array + np.float32(1.0)
        if array.ndim == 2 and qtype == "F16":
            array = array.astype(np.float16)
        writer.add_tensor(name, np.ascontiguousarray(array))

    permuted = arch in ("llama", "mistral")  # llama.cpp permutes Q/K only for these

    def qk(w: np.ndarray, n: int) -> np.ndarray:
        return _llamacpp_permute(w, n) if permuted else w

    for name, factors in rope_factors.items():
        add(name, factors)
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not tie:
        add("output.weight", sd["lm_head.weight"])
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        if gemma:  # four norms a layer, as llama.cpp names them
            add(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
            add(f"blk.{i}.ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"])
            add(f"blk.{i}.post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"])
        else:
            add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        if arch == "phi3":  # q/k/v and gate/up stay fused, as HF holds them
            add(f"blk.{i}.attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
            add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
            add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
            add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
            continue
        add(f"blk.{i}.attn_q.weight", qk(sd[p + "self_attn.q_proj.weight"], heads))
        add(f"blk.{i}.attn_k.weight", qk(sd[p + "self_attn.k_proj.weight"], kv_heads))
        if p + "self_attn.q_norm.weight" in sd:  # Qwen3, Gemma 3
            add(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def our_logits(model, ids: list[int]) -> torch.Tensor:
    """All-position logits [T, V] from our forward with a fresh contiguous cache."""
    from kvscope.engine.model.contiguous_cache import ContiguousKVCache

    cache = ContiguousKVCache(model.config, len(ids), model.device, model.dtype)
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    return model.compute_logits(hidden)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
