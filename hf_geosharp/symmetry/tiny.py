"""Tiny random-init models, one per attention layout, for tests, demos and the dimension audit.

Every entry builds offline from a config (float64, eager attention, eval mode, hidden 16-32, one or two layers) and
comes with one small batch that ``model(**batch)`` accepts and that yields ``outputs.loss``. Weights are drawn larger
than the usual 0.02 init so that attention is far from uniform and a wrong symmetry map cannot hide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

VOCAB, SEQ, BATCH = 64, 8, 2


@dataclass
class TinyModel:
    """A tiny model and one batch for it."""

    model: nn.Module
    batch: dict[str, Any]


class MHAClassifier(nn.Module):
    """Embedding -> ``nn.MultiheadAttention`` (self- or cross-attention) -> mean-pool -> linear classifier."""

    def __init__(self, dim: int = 16, heads: int = 2, kdim: int | None = None, add_bias_kv: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.context = nn.Embedding(VOCAB, kdim) if kdim else None
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, kdim=kdim, vdim=kdim, add_bias_kv=add_bias_kv)
        self.head = nn.Linear(dim, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        x = self.embed(input_ids)
        kv = x if self.context is None else self.context(input_ids.flip(1))
        y, _ = self.attn(x, kv, kv, need_weights=False)
        logits = self.head(y.mean(dim=1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def _ids(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(4, VOCAB, (BATCH, SEQ), generator=gen)


def _text_cls(gen: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(gen), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
            "labels": torch.randint(0, 2, (BATCH,), generator=gen)}


def _causal(gen: torch.Generator) -> dict[str, Any]:
    ids = _ids(gen)
    return {"input_ids": ids, "labels": ids}


def _seq2seq(gen: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(gen), "labels": torch.randint(4, VOCAB, (BATCH, 5), generator=gen)}


def _causal_cross(gen: torch.Generator) -> dict[str, Any]:
    return {**_causal(gen), "encoder_hidden_states": torch.randn(BATCH, 5, 16, generator=gen, dtype=torch.float64)}


def _image_cls(gen: torch.Generator) -> dict[str, Any]:
    return {"pixel_values": torch.randn(BATCH, 3, 8, 8, generator=gen, dtype=torch.float64),
            "labels": torch.randint(0, 2, (BATCH,), generator=gen)}


def _clip(gen: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(gen), "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=gen, dtype=torch.float64),
            "return_loss": True}


def _mha(gen: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(gen), "labels": torch.randint(0, 3, (BATCH,), generator=gen)}


_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
            max_position_embeddings=32)
_ENC = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, num_labels=2)
_VIS = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32)


def _hf(model_cls: type, config: tf.PretrainedConfig) -> nn.Module:
    config._attn_implementation = "eager"
    return model_cls(config)


# name -> (builder, batch maker); builders only construct, :func:`build` seeds, casts and re-draws the weights
_BUILDERS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], dict[str, Any]]]] = {
    "bert": (lambda: _hf(tf.BertForSequenceClassification, tf.BertConfig(**_ENC)), _text_cls),
    "roberta": (lambda: _hf(tf.RobertaForSequenceClassification,
                            tf.RobertaConfig(**{**_ENC, "max_position_embeddings": 40})), _text_cls),
    "distilbert": (lambda: _hf(tf.DistilBertForSequenceClassification, tf.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=32)), _text_cls),
    "albert": (lambda: _hf(tf.AlbertForSequenceClassification, tf.AlbertConfig(
        **{**_ENC, "num_hidden_layers": 2}, embedding_size=8)), _text_cls),
    "roformer_interleaved": (lambda: _hf(tf.RoFormerForSequenceClassification, tf.RoFormerConfig(
        **_ENC, embedding_size=16)), _text_cls),
    "roformer_rotary_value": (lambda: _hf(tf.RoFormerForSequenceClassification, tf.RoFormerConfig(
        **_ENC, embedding_size=16, rotary_value=True)), _text_cls),
    "vit": (lambda: _hf(tf.ViTForImageClassification, tf.ViTConfig(**_VIS, num_labels=2)), _image_cls),
    "clip": (lambda: _hf(tf.CLIPModel, tf.CLIPConfig(
        text_config={k: v for k, v in _ENC.items() if k != "num_labels"}, vision_config=_VIS,
        projection_dim=8)), _clip),
    "llama_gqa": (lambda: _hf(tf.LlamaForCausalLM, tf.LlamaConfig(**_DEC, num_key_value_heads=2)), _causal),
    "gemma_mqa": (lambda: _hf(tf.GemmaForCausalLM, tf.GemmaConfig(
        **{**_DEC, "hidden_size": 16}, num_key_value_heads=1, head_dim=8)), _causal),
    "qwen2_bias": (lambda: _hf(tf.Qwen2ForCausalLM, tf.Qwen2Config(**_DEC, num_key_value_heads=2)), _causal),
    "qwen3_qknorm": (lambda: _hf(tf.Qwen3ForCausalLM, tf.Qwen3Config(
        **_DEC, num_key_value_heads=2, head_dim=6)), _causal),
    "olmo2_fullqknorm": (lambda: _hf(tf.Olmo2ForCausalLM, tf.Olmo2Config(**_DEC, num_key_value_heads=2)), _causal),
    "phi_partial": (lambda: _hf(tf.PhiForCausalLM, tf.PhiConfig(**_DEC, partial_rotary_factor=0.5)), _causal),
    "phi_qklayernorm": (lambda: _hf(tf.PhiForCausalLM, tf.PhiConfig(
        **_DEC, partial_rotary_factor=0.5, qk_layernorm=True)), _causal),
    "phi3_fused": (lambda: _hf(tf.Phi3ForCausalLM, tf.Phi3Config(
        **_DEC, num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0)), _causal),
    "gptj_interleaved": (lambda: _hf(tf.GPTJForCausalLM, tf.GPTJConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, rotary_dim=4)), _causal),
    "gpt_neo": (lambda: _hf(tf.GPTNeoForCausalLM, tf.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, attention_types=[[["global"], 1]],
        max_position_embeddings=32)), _causal),
    "opt": (lambda: _hf(tf.OPTForCausalLM, tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
        word_embed_proj_dim=16, max_position_embeddings=32)), _causal),
    "bart": (lambda: _hf(tf.BartForConditionalGeneration, tf.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)), _seq2seq),
    "t5": (lambda: _hf(tf.T5ForConditionalGeneration, tf.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0)), _seq2seq),
    "gpt2_conv1d": (lambda: _hf(tf.GPT2LMHeadModel, tf.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32)), _causal),
    "gpt2_cross": (lambda: _hf(tf.GPT2LMHeadModel, tf.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32, add_cross_attention=True)),
        _causal_cross),
    "gpt_neox_partial": (lambda: _hf(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
        **_DEC, rotary_pct=0.5)), _causal),
    "bloom_alibi": (lambda: _hf(tf.BloomForCausalLM, tf.BloomConfig(
        vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2)), _causal),
    "falcon_grouped": (lambda: _hf(tf.FalconForCausalLM, tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, alibi=False, bias=False)), _causal),
    "falcon_multiquery": (lambda: _hf(tf.FalconForCausalLM, tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=False, bias=False)), _causal),
    "falcon_classic_alibi": (lambda: _hf(tf.FalconForCausalLM, tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, multi_query=False,
        new_decoder_architecture=False, alibi=True, bias=True)), _causal),
    "gpt_bigcode_mqa": (lambda: _hf(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, multi_query=True)), _causal),
    "gpt_bigcode_mha": (lambda: _hf(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, multi_query=False)), _causal),
    "deberta_v2_shared": (lambda: _hf(tf.DebertaV2ForSequenceClassification, tf.DebertaV2Config(
        **_ENC, relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=True, position_buckets=8,
        max_relative_positions=16)), _text_cls),
    "deberta_v2_separate": (lambda: _hf(tf.DebertaV2ForSequenceClassification, tf.DebertaV2Config(
        **_ENC, relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=False,
        max_relative_positions=16)), _text_cls),
    "deberta": (lambda: _hf(tf.DebertaForSequenceClassification, tf.DebertaConfig(
        **_ENC, relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16)), _text_cls),
    "mha": (lambda: MHAClassifier(add_bias_kv=True), _mha),
    "mha_kdim": (lambda: MHAClassifier(kdim=12), _mha),
}

LORA_TARGETS = ["q_proj", "v_proj"]


def _lora(trainable_base: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    base = _hf(tf.LlamaForCausalLM, tf.LlamaConfig(**_DEC, num_key_value_heads=2))
    # init_lora_weights=False draws B at random too: with PEFT's default B = 0 the adapter would be invisible
    model = get_peft_model(base, LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False))
    if trainable_base:
        for p in model.parameters():
            p.requires_grad_(True)
    return model


_BUILDERS["lora"] = (lambda: _lora(trainable_base=False), _causal)
_BUILDERS["lora_all_trainable"] = (lambda: _lora(trainable_base=True), _causal)

ARCHITECTURES: tuple[str, ...] = tuple(_BUILDERS)


def build(name: str, seed: int = 0, weight_std: float = 0.2) -> TinyModel:
    """Build tiny model ``name`` (see :data:`ARCHITECTURES`) in float64 eval mode with a matching batch."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown tiny architecture {name!r}; choose one of {', '.join(ARCHITECTURES)}")
    make_model, make_batch = _BUILDERS[name]
    torch.manual_seed(seed)
    model = make_model().double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * weight_std)
    return TinyModel(model, make_batch(gen))
