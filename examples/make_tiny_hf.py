"""Make a tiny Hugging Face Llama with random weights, for trying `[init] hf` and `ultrascale-hf`
without downloading anything: Llama 3.1-style RoPE scaling, head_dim != hidden / heads, GQA.

    python -m examples.make_tiny_hf runs/tiny-hf [--dtype bf16|fp32] [--seed 0]

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


def make_tiny_hf(out: Path, *, dtype: str = "fp32", seed: int = 0, **overrides: object) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config)
    # transformers' init leaves norms at 1 and biases at 0; perturb them so a test notices if
    # they are not loaded.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_hf(args.out, dtype=args.dtype, seed=args.seed))


if __name__ == "__main__":
    main()
