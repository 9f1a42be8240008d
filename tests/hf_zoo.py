"""Tiny Hugging Face models, one per architecture, each with one global batch that makes it
return a training loss.

Built from ``transformers`` config classes (no download, random weights from a fixed seed),
with dropout 0 and ``use_cache=False``, a few layers, hidden 32, vocabulary 96, 16 tokens,
batch 4. Attention is SDPA where the model supports it, eager otherwise (Gemma-2's soft
capping). ``build(name)`` returns ``(model, (args, kwargs))``; ``ZOO`` lists the names with
their kind, for the supported-models table.

Head counts and widths are chosen so tensor parallelism over 2 ranks divides them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH, HIDDEN, LAYERS = 96, 16, 4, 32, 2

# Fields every decoder config understands under its own name.
_DEC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=4, intermediate_size=64, max_position_embeddings=SEQ,
            use_cache=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def _tokens(seed: int, high: int = VOCAB, low: int = 3) -> torch.Tensor:
    """Token ids drawn from a fixed seed, avoiding the special ids 0-2 (pad, bos, eos)."""
    return torch.randint(low, high, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _lm(cls: str, config: str, attn: str = "sdpa", **fields: Any) -> Callable[[], tuple]:
    """A causal LM: labels are the inputs (HF shifts them)."""
    def build() -> tuple[nn.Module, tuple]:
        model = _model(cls, config, attn, {**_DEC, **fields})
        ids = _tokens(1)
        return model, ((), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    return build


def _masked_lm(cls: str, config: str, **fields: Any) -> Callable[[], tuple]:
    """An encoder with a masked-LM head, given an attention mask (all ones) as users do."""
    def build() -> tuple[nn.Module, tuple]:
        model = _model(cls, config, "sdpa", fields)
        ids = _tokens(1)
        return model, ((), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                             "labels": _tokens(2)})
    return build


def _seq2seq(cls: str, config: str, attn: str = "sdpa", **fields: Any) -> Callable[[], tuple]:
    """An encoder-decoder: the decoder's inputs are the labels shifted right (by HF)."""
    def build() -> tuple[nn.Module, tuple]:
        model = _model(cls, config, attn, fields)
        ids = _tokens(1)
        return model, ((), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                             "labels": _tokens(2), "use_cache": False})
    return build


def _vit() -> tuple[nn.Module, tuple]:
    model = _model("ViTForImageClassification", "ViTConfig", "sdpa", dict(
        image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(BATCH, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    return model, ((), {"pixel_values": pixels, "labels": labels})


def _model(cls: str, config: str, attn: str, fields: dict[str, Any]) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**fields)
    model = getattr(transformers, cls)._from_config(cfg, attn_implementation=attn)
    if cls == "GPT2LMHeadModel":  # HF picks the loss by class name, which GPT-2's misses
        model.loss_type = "ForCausalLM"
    return model.train()


_LLAMA_LIKE = dict(num_key_value_heads=2, rms_norm_eps=1e-5, attention_dropout=0.0)
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)

ZOO: dict[str, tuple[str, Callable[[], tuple]]] = {
    # decoder language models
    "gpt2": ("decoder", _lm("GPT2LMHeadModel", "GPT2Config", n_layer=LAYERS, n_embd=HIDDEN,
                            n_head=4, n_positions=SEQ, attn_pdrop=0.0, resid_pdrop=0.0,
                            embd_pdrop=0.0)),
    "llama": ("decoder", _lm("LlamaForCausalLM", "LlamaConfig", **_LLAMA_LIKE)),
    "mistral": ("decoder", _lm("MistralForCausalLM", "MistralConfig", **_LLAMA_LIKE,
                               sliding_window=8)),
    "qwen2": ("decoder", _lm("Qwen2ForCausalLM", "Qwen2Config", **_LLAMA_LIKE)),
    "qwen3": ("decoder", _lm("Qwen3ForCausalLM", "Qwen3Config", **_LLAMA_LIKE, head_dim=8)),
    "gemma": ("decoder", _lm("GemmaForCausalLM", "GemmaConfig", **_LLAMA_LIKE, head_dim=8)),
    "gemma2": ("decoder", _lm("Gemma2ForCausalLM", "Gemma2Config", "eager", **_LLAMA_LIKE,
                              head_dim=8, sliding_window=8)),
    "phi": ("decoder", _lm("PhiForCausalLM", "PhiConfig", num_key_value_heads=4,
                           partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                           attention_dropout=0.0)),
    "phi3": ("decoder", _lm("Phi3ForCausalLM", "Phi3Config", **_LLAMA_LIKE, resid_pdrop=0.0,
                            embd_pdrop=0.0)),
    "opt": ("decoder", _lm("OPTForCausalLM", "OPTConfig", ffn_dim=64, word_embed_proj_dim=HIDDEN,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                           layerdrop=0.0)),
    "falcon": ("decoder", _lm("FalconForCausalLM", "FalconConfig", hidden_dropout=0.0,
                              attention_dropout=0.0)),
    "bloom": ("decoder", _lm("BloomForCausalLM", "BloomConfig", "eager", n_layer=LAYERS,
                             n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
    "gpt_neox": ("decoder", _lm("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_dropout=0.0,
                                attention_dropout=0.0)),
    # encoder-decoder
    "t5": ("encoder-decoder", _seq2seq(
        "T5ForConditionalGeneration", "T5Config", "eager", vocab_size=VOCAB, d_model=HIDDEN,
        d_kv=8, d_ff=64, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2)),
    "bart": ("encoder-decoder", _seq2seq(
        "BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=HIDDEN,
        encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
    # encoders
    "bert": ("encoder", _masked_lm("BertForMaskedLM", "BertConfig", vocab_size=VOCAB,
                                   hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)),
    "roberta": ("encoder", _masked_lm("RobertaForMaskedLM", "RobertaConfig", vocab_size=VOCAB,
                                      hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=SEQ + 2, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, pad_token_id=1)),
    "distilbert": ("encoder", _masked_lm("DistilBertForMaskedLM", "DistilBertConfig",
                                         vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS,
                                         n_heads=4, hidden_dim=64, max_position_embeddings=SEQ,
                                         dropout=0.0, attention_dropout=0.0)),
    # vision
    "vit": ("vision", _vit),
    # mixture of experts
    "mixtral": ("moe", _lm("MixtralForCausalLM", "MixtralConfig", **_LLAMA_LIKE, **_MOE,
                           num_local_experts=4)),
    "qwen2_moe": ("moe", _lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_LLAMA_LIKE, **_MOE,
                             num_experts=4, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, decoder_sparse_step=1)),
    # DeepSeek-V3's multi-head latent attention with its real structure: low-rank q and kv
    # projections, and query/key (no-RoPE + RoPE) and value head dims that all differ.
    "deepseek_v3": ("moe", _lm("DeepseekV3ForCausalLM", "DeepseekV3Config",
                               **{**_LLAMA_LIKE, "num_key_value_heads": 4}, **_MOE, n_routed_experts=4, n_shared_experts=1,
                               moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                               topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)),
}


def build(name: str) -> tuple[nn.Module, tuple[tuple, dict]]:
    """The tiny model called ``name`` and its global batch ``(args, kwargs)``."""
    return ZOO[name][1]()
