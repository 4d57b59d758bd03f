#!/usr/bin/env python3
"""Makes the checkpoint variants in this folder and their float64 transformers
references, to check that weir handles the families in general and not only
the tiny fixtures in tests/fixtures: llama3 RoPE scaling with attention and MLP biases, MQA
with tied embeddings, Mistral, a sharded bf16 Qwen2, a Qwen3 with a wide
head_dim and linear RoPE scaling.

    python -m venv v && v/bin/pip install torch==2.11.0 transformers safetensors
    v/bin/python make_variants.py        # rewrites ./variants/*

Each variant folder holds a checkpoint saved by transformers and
reference.json: {input_ids[B][T], attention_mask[B][T], logits[B][T][V]
(float64, null rows at padding)}.
"""
import json, os
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants")
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2, pad_token_id=3)

VARIANTS = {
    "llama3-rope-biases": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
        attention_bias=True, mlp_bias=True, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}), {}),
    "llama-mqa-tied": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=True, rope_theta=10000.0), {}),
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
        sliding_window=None, tie_word_embeddings=False, rope_theta=10000.0), {}),
    "qwen2-sharded-bf16": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, rope_theta=10000.0), dict(max_shard_size="20KB", dtype=torch.bfloat16)),
    "qwen3-wide-head-linear-rope": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, tie_word_embeddings=True, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
}

torch.manual_seed(0)
ids = torch.randint(4, 96, (2, 11))
mask = torch.ones_like(ids)
mask[1, :4] = 0          # left padding on row 1
ids[1, :4] = 3
for seed, (name, (cfg_cls, model_cls, kw, save_kw)) in enumerate(VARIANTS.items()):
    torch.manual_seed(1000 + seed)
    model = model_cls(cfg_cls(**COMMON, **kw)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
    out = os.path.join(HERE, name)
    dtype = save_kw.pop("dtype", None)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out, **save_kw)
    ref = model_cls.from_pretrained(out, dtype=torch.float64, attn_implementation="sdpa").eval()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    rows = [[(logits[b, t].tolist() if mask[b, t] else None) for t in range(ids.shape[1])] for b in range(2)]
    json.dump({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "logits": rows}, open(os.path.join(out, "reference.json"), "w"))
    print(name, sorted(os.listdir(out)))
