"""Models the tests never see: exact training on Hugging Face architectures that are not in
``tests/hf_zoo.py``, at sizes unlike the zoo's, with batches drawn afresh.

The zoo's architectures are the ones autopar's developers fixed things on; a rule that
recognises only them shows here. Each architecture is built from its config class (random
weights, no download) at hidden 48, 3 layers, 4 heads over 2 KV heads, a vocabulary of 101,
20 tokens; its batch of 4 is right-padded to lengths drawn from a seed, labels -100 on the
padding (causal LMs, encoder-decoders) or everywhere but 15-40% of the tokens (masked LMs).
Every architecture trains 3 steps under every layout of ``tests/workers/hf_matrix.py`` on 2
gloo ranks, each compared (every loss, every gradient, every rank) with one device::

    python benchmarks/unseen_models.py                  # every architecture, 6 layouts
    python benchmarks/unseen_models.py helium esm --layouts dp2,pp2

It prints one row per architecture (equal / refused / differs / error per layout) and the
refusals' reasons: **measured** on this machine's CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, BATCH, HIDDEN, LAYERS = 101, 20, 4, 48, 3
LAYOUTS = "trace,auto,dp2,tp2,pp2,zero3,cp2"

_DEC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
_ENC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _padded_ids(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, rows right-padded to lengths drawn from ``seed``."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=_generator(seed))
    lengths = torch.randint(SEQ // 3, SEQ + 1, (BATCH,), generator=_generator(seed + 1))
    lengths[0] = SEQ  # one full row, as a packed batch has
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _build(cls: str, config: str, fields: dict[str, Any], attn: str = "sdpa") -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**fields)
    for name in dir(cfg):  # every dropout, drop-path, layer drop 0: deterministic training
        if "drop" in name and isinstance(getattr(cfg, name, None), float):
            setattr(cfg, name, 0.0)
    try:
        cfg._attn_implementation = attn
        return getattr(transformers, cls)(cfg)
    except ValueError:  # no SDPA in this architecture: its eager attention
        torch.manual_seed(0)
        cfg._attn_implementation = "eager"
        return getattr(transformers, cls)(cfg)


def causal(cls: str, config: str, attn: str = "sdpa", **fields: Any) -> Callable[[], tuple]:
    def build() -> tuple[nn.Module, tuple]:
        model = _build(cls, config, {**_DEC, **fields}, attn)
        ids, mask = _padded_ids(11)
        labels = ids.masked_fill(mask == 0, -100)
        return model, ((), {"input_ids": ids, "attention_mask": mask, "labels": labels,
                            "use_cache": False})
    return build


def masked(cls: str, config: str, **fields: Any) -> Callable[[], tuple]:
    def build() -> tuple[nn.Module, tuple]:
        model = _build(cls, config, {**_ENC, **fields})
        ids, mask = _padded_ids(21)
        rate = torch.rand(BATCH, 1, generator=_generator(23)) * 0.25 + 0.15
        chosen = (torch.rand(BATCH, SEQ, generator=_generator(24)) < rate) & (mask == 1)
        chosen[:, 0] = True  # every row predicts at least one token
        labels = ids.masked_fill(~chosen, -100)
        return model, ((), {"input_ids": ids.masked_fill(chosen, 3), "attention_mask": mask,
                            "labels": labels})
    return build


def seq2seq(cls: str, config: str, **fields: Any) -> Callable[[], tuple]:
    def build() -> tuple[nn.Module, tuple]:
        model = _build(cls, config, fields)
        ids, mask = _padded_ids(31)
        labels, label_mask = _padded_ids(33)
        return model, ((), {"input_ids": ids, "attention_mask": mask,
                            "labels": labels.masked_fill(label_mask == 0, -100),
                            "use_cache": False})
    return build


def image(cls: str, config: str, size: int = 24, **fields: Any) -> Callable[[], tuple]:
    def build() -> tuple[nn.Module, tuple]:
        model = _build(cls, config, {"num_labels": 7, "image_size": size, **fields})
        pixels = torch.randn(BATCH, 3, size, size, generator=_generator(41))
        labels = torch.randint(0, 7, (BATCH,), generator=_generator(42))
        return model, ((), {"pixel_values": pixels, "labels": labels})
    return build


def audio(cls: str, config: str, **fields: Any) -> Callable[[], tuple]:
    def build() -> tuple[nn.Module, tuple]:
        model = _build(cls, config, {"num_labels": 5, **fields})
        samples = 1600
        wave = torch.randn(BATCH, samples, generator=_generator(51))
        lengths = torch.tensor([samples, 1200, 900, 1400])
        mask = (torch.arange(samples)[None] < lengths[:, None]).long()
        labels = torch.randint(0, 5, (BATCH,), generator=_generator(52))
        return model, ((), {"input_values": wave * mask, "attention_mask": mask,
                            "labels": labels})
    return build


_CONV = dict(conv_dim=(32, 32, 32), conv_stride=(5, 4, 4), conv_kernel=(10, 8, 4),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_size=HIDDEN,
             num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=96,
             mask_time_prob=0.0, layerdrop=0.0)
_MOE = dict(_DEC, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)

MODELS: dict[str, tuple[str, Callable[[], tuple]]] = {
    "helium": ("decoder", causal("HeliumForCausalLM", "HeliumConfig", head_dim=12)),
    "smollm3": ("decoder", causal("SmolLM3ForCausalLM", "SmolLM3Config")),
    "exaone4": ("decoder", causal("Exaone4ForCausalLM", "Exaone4Config")),
    "arcee": ("decoder", causal("ArceeForCausalLM", "ArceeConfig")),
    "olmo3": ("decoder", causal("Olmo3ForCausalLM", "Olmo3Config")),
    "cohere2": ("decoder", causal("Cohere2ForCausalLM", "Cohere2Config", sliding_window=8)),
    "ernie4_5": ("decoder", causal("Ernie4_5ForCausalLM", "Ernie4_5Config", head_dim=12)),
    "gpt_bigcode": ("decoder", causal("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                                      n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                                      n_positions=64)),
    "seed_oss": ("decoder", causal("SeedOssForCausalLM", "SeedOssConfig", head_dim=12)),
    "xlm_roberta": ("encoder", masked("XLMRobertaForMaskedLM", "XLMRobertaConfig",
                                      max_position_embeddings=SEQ + 2)),
    "esm": ("encoder", masked("EsmForMaskedLM", "EsmConfig", mask_token_id=3)),
    "camembert": ("encoder", masked("CamembertForMaskedLM", "CamembertConfig",
                                    max_position_embeddings=SEQ + 2)),
    "rembert": ("encoder", masked("RemBertForMaskedLM", "RemBertConfig",
                                  input_embedding_size=32, output_embedding_size=32,
                                  bos_token_id=1, eos_token_id=2)),
    "umt5": ("encoder-decoder", seq2seq("UMT5ForConditionalGeneration", "UMT5Config",
                                        vocab_size=VOCAB, d_model=HIDDEN, d_kv=12, d_ff=96,
                                        num_layers=LAYERS, num_heads=4,
                                        decoder_start_token_id=0, pad_token_id=0)),
    "plbart": ("encoder-decoder", seq2seq("PLBartForConditionalGeneration", "PLBartConfig",
                                          vocab_size=VOCAB, d_model=HIDDEN,
                                          encoder_layers=LAYERS, decoder_layers=LAYERS,
                                          encoder_attention_heads=4,
                                          decoder_attention_heads=4, encoder_ffn_dim=96,
                                          decoder_ffn_dim=96, max_position_embeddings=64,
                                          pad_token_id=0)),
    "convnextv2": ("vision", image("ConvNextV2ForImageClassification", "ConvNextV2Config",
                                   hidden_sizes=[16, 32], depths=[1, 2], num_stages=2)),
    "swinv2": ("vision", image("Swinv2ForImageClassification", "Swinv2Config", size=32,
                               embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4,
                               patch_size=4)),
    "deepseek_v2": ("moe", causal("DeepseekV2ForCausalLM", "DeepseekV2Config", **{
        k: v for k, v in _MOE.items() if k not in _DEC}, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=1, n_shared_experts=1, topk_method="greedy",
        num_key_value_heads=4)),
    "dots1": ("moe", causal("Dots1ForCausalLM", "Dots1Config", **{
        k: v for k, v in _MOE.items() if k not in _DEC}, first_k_dense_replace=1,
        n_shared_experts=1, head_dim=12)),
    "granitemoeshared": ("moe", causal("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig",
                                       num_local_experts=4, num_experts_per_tok=2,
                                       shared_intermediate_size=32)),
    "wavlm": ("speech", audio("WavLMForSequenceClassification", "WavLMConfig", **_CONV)),
    "sew": ("speech", audio("SEWForSequenceClassification", "SEWConfig", **_CONV,
                            squeeze_factor=2)),
}


def build(name: str) -> tuple[nn.Module, tuple[tuple, dict]]:
    """The model called ``name`` and its global batch (what the matrix worker calls)."""
    return MODELS[name][1]()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archs", nargs="*", default=list(MODELS))
    ap.add_argument("--layouts", default=LAYOUTS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.distributed import run_cases

    layouts = args.layouts.split(",")
    cases = [{"arch": f"{Path(__file__).resolve()}:{a}"} for a in args.archs]
    with tempfile.TemporaryDirectory() as out:
        ranks = run_cases(2, Path(out), cases, worker="hf_matrix.py", timeout=3600,
                          worker_args=("--layouts", args.layouts),
                          records_per_case=len(layouts))
    cells = {(r["arch"].rpartition(":")[2], r["layout"]): r for r in ranks[0]}
    for rank in ranks[1:]:  # a cell is equal only where every rank found it so
        for r in rank:
            cell = cells[r["arch"].rpartition(":")[2], r["layout"]]
            if r["status"] != "equal" and cell["status"] == "equal":
                cells[r["arch"].rpartition(":")[2], r["layout"]] = r
    print(f"{'arch':18} {'kind':16} " + " ".join(f"{x:8}" for x in layouts))
    for a in args.archs:
        print(f"{a:18} {MODELS[a][0]:16} "
              + " ".join(f"{cells[a, x]['status']:8}" for x in layouts))
    counts = Counter(c["status"] for c in cells.values())
    print(f"\n{len(cells)} cells (measured, 2 gloo ranks): "
          + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
    for (a, x), c in sorted(cells.items()):
        if c["status"] != "equal":
            why = c.get("reason") or "; ".join(map(str, c.get("problems") or []))
            print(f"- {a} {x}: {c['status']}: {why[:1500]}")
    if os.environ.get("AUTOPAR_UNSEEN_JSON"):
        Path(os.environ["AUTOPAR_UNSEEN_JSON"]).write_text(
            json.dumps([{"arch": a, "layout": x, **c} for (a, x), c in cells.items()]))
    return 1 if counts.get("differs") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
