"""Make a tiny Hugging Face Llama with random weights, for trying `[init] hf` and `ultrascale-hf`
without downloading anything: Llama 3.1-style RoPE scaling, head_dim != hidden / heads, GQA.
`--model-type mixtral` or `qwen2_moe` makes a tiny mixture of experts instead (model.family
"moe"): Mixtral's 4 experts, top-2, in every layer; Qwen2-MoE's 4 experts, top-2 without
renormalising, a gated shared expert twice an expert's width, q/k/v biases, a dense first layer.

    python -m examples.make_tiny_hf runs/tiny-hf [--dtype bf16|fp32] [--seed 0] [--model-type T]

Needs `transformers` (the `test` extra: pip install -e ".[test]").
"""

from __future__ import annotations

import argparse
from pathlib import Path

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # not 64 / 4
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "tie_word_embeddings": False,
}


_MOE_SHAPE = {key: TINY[key] for key in (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")}
TINY_MOE = {
    "mixtral": {**_MOE_SHAPE, "intermediate_size": 48, "num_hidden_layers": 2, "head_dim": 32,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_MOE_SHAPE, "intermediate_size": 96, "num_hidden_layers": 3,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "mlp_only_layers": [0],
                  "norm_topk_prob": False, "qkv_bias": True},
}


def make_tiny_hf(out: Path, *, dtype: str = "fp32", seed: int = 0, model_type: str = "llama",
                 **overrides: object) -> Path:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    elif model_type == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**{**TINY_MOE[model_type], **overrides}))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**TINY_MOE[model_type], **overrides}))
    # transformers' init leaves norms at 1 and biases at 0 (and Qwen2-MoE's router at 0);
    # perturb them so a test notices if they are not loaded. Routers drawn wide keep the top-k
    # clear of near-ties, which rounding could break either way.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif any(k in name for k in ("embed", "lm_head", ".gate.", "shared_expert_gate")):
                p.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-type", choices=("llama", *TINY_MOE), default="llama")
    args = parser.parse_args()
    print(make_tiny_hf(args.out, dtype=args.dtype, seed=args.seed, model_type=args.model_type))


if __name__ == "__main__":
    main()
