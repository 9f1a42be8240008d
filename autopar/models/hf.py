"""Hugging Face causal language models built from configs, with random weights.

These are the models people actually train, so autopar must plan them unmodified. They are
built from a config (no download), in the current device context: under
``torch.device("meta")`` a 70B Llama builds in a fraction of a second without allocating.

transformers is an optional extra (``pip install 'autopar[hf]'``), imported only when a
builder runs. Every builder sets ``use_cache=False`` (``torch.export`` fails on the
``DynamicCache`` an HF model otherwise returns) and zeroes dropout unless asked, because
dropout makes a traced training step nondeterministic and pretraining runs rarely use it.
Any other HF config field can be passed through ``**overrides``.

Field names are those of transformers 5: RoPE's base is ``rope_parameters["rope_theta"]``
(no longer a top-level ``rope_theta``), and Mixtral's expert count is ``num_local_experts``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autopar.core.errors import ModelSpecError


def build_gpt2(
    *,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    dropout: float = 0.0,
    **overrides: Any,
) -> nn.Module:
    """A ``GPT2LMHeadModel``; call it with ``input_ids=..., labels=..., use_cache=False``.

    Attention is ``eager``: GPT-2's explicit matmul/softmax ops stay in the traced graph,
    so this model exercises attention pattern matching, while Llama keeps SDPA whole.
    """
    transformers = _transformers("build_gpt2")
    fields = dict(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        attn_pdrop=dropout,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        summary_first_dropout=dropout,
        bos_token_id=_in_vocab(50256, vocab),
        eos_token_id=_in_vocab(50256, vocab),
        use_cache=False,
        attn_implementation="eager",
    )
    config = _config(transformers.GPT2Config, fields, overrides)
    model = transformers.GPT2LMHeadModel(config)
    # HF derives the loss from the class name, which "GPT2LMHeadModel" does not match; it
    # falls back to the causal-LM loss with a warning. Say so explicitly instead.
    model.loss_type = "ForCausalLM"
    return model


def build_llama(
    *,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    kv_heads: int | None = None,
    rope_theta: float = 500000.0,
    dropout: float = 0.0,
    **overrides: Any,
) -> nn.Module:
    """A ``LlamaForCausalLM`` with SDPA attention; defaults follow Llama 3 (RoPE base 5e5)."""
    transformers = _transformers("build_llama")
    fields = _llama_fields(layers, hidden, heads, ffn, vocab, seq, kv_heads, rope_theta, dropout)
    config = _config(transformers.LlamaConfig, fields, overrides)
    return transformers.LlamaForCausalLM(config)


def build_mixtral(
    *,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    kv_heads: int | None = None,
    experts: int = 8,
    top_k: int = 2,
    rope_theta: float = 1e6,
    dropout: float = 0.0,
    **overrides: Any,
) -> nn.Module:
    """A ``MixtralForCausalLM``: Llama-like attention, a top-k routed mixture of experts."""
    transformers = _transformers("build_mixtral")
    fields = _llama_fields(layers, hidden, heads, ffn, vocab, seq, kv_heads, rope_theta, dropout)
    fields.update(num_local_experts=experts, num_experts_per_tok=top_k)
    config = _config(transformers.MixtralConfig, fields, overrides)
    return transformers.MixtralForCausalLM(config)


def build_deepseek_v3(
    *,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    experts: int = 256,
    top_k: int = 8,
    expert_ffn: int = 2048,
    shared_experts: int = 1,
    dense_layers: int = 3,
    q_lora: int = 1536,
    kv_lora: int = 512,
    dropout: float = 0.0,
    **overrides: Any,
) -> nn.Module:
    """A ``DeepseekV3ForCausalLM``: multi-head latent attention (low-rank q and kv, RoPE on
    64 of each head's dims), ``dense_layers`` dense FFN layers, then MoE layers of
    ``experts`` routed experts (top ``top_k``, sigmoid scores with a bias for balance) and
    ``shared_experts`` always-on ones. DeepSeek-V3's head dims (128 no-RoPE + 64 RoPE for
    queries and keys, 128 for values) and group-limited routing (8 groups, 4 picked) are
    kept whatever the sizes; the multi-token-prediction module is not built."""
    transformers = _transformers("build_deepseek_v3")
    fields = _llama_fields(layers, hidden, heads, ffn, vocab, seq, heads, 10000.0, dropout)
    groups = 8 if experts % 8 == 0 else 1
    fields.update(
        n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
        n_shared_experts=shared_experts, first_k_dense_replace=dense_layers,
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_group=groups, topk_group=min(4, groups), routed_scaling_factor=2.5,
        norm_topk_prob=True)
    config = _config(transformers.DeepseekV3Config, fields, overrides)
    return transformers.DeepseekV3ForCausalLM(config)


def _llama_fields(
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    kv_heads: int | None,
    rope_theta: float,
    dropout: float,
) -> dict[str, Any]:
    return dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads if kv_heads is not None else heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=seq,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=1e-5,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        bos_token_id=_in_vocab(1, vocab),
        eos_token_id=_in_vocab(2, vocab),
        use_cache=False,
        attn_implementation="sdpa",
    )


def _config(config_cls: type, fields: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """Build an HF config, turning its validation errors into a ModelSpecError."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return config_cls(**{**fields, **overrides})
    except (StrictDataclassError, TypeError, ValueError) as e:
        raise ModelSpecError(
            f"invalid {config_cls.__name__}: {e}",
            where=config_cls.__name__,
            fix="fix the field named above, or drop it from the overrides",
        ) from e


def _in_vocab(token_id: int, vocab: int) -> int | None:
    """A special-token id if the vocabulary has it; tiny test vocabularies often do not."""
    return token_id if token_id < vocab else None


def _transformers(where: str) -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ModelSpecError(
            "this model is built with Hugging Face transformers, which is not installed",
            where=where,
            fix="pip install 'autopar[hf]'",
        ) from e
    return transformers
