"""Writes the tiny Hugging Face checkpoints that tests/test_hf.py converts (needs torch and
transformers; the tests need neither).

python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]

Each model goes to OUT/<name>/ by `save_pretrained` (config.json, model.safetensors) with
reference.npz: `input_ids` [2, 16] and transformers' float32 `logits` [2, 16, vocab] for them.
The weights are stored in 16 bits (GPT-2 float16, Llama bfloat16: both of the reader's paths, and
half the bytes); the logits come from the same weights in float32, so the conversion is exact.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
BATCH, SEQ = 2, 16
INIT_STD = 0.1
"""Five times transformers' default: attention far from uniform, so a misplaced head, rotary
pair or kv group changes the logits by much more than the test's tolerance."""


def _models():
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )  # fmt: skip

    gpt2 = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=32,
        bos_token_id=0, eos_token_id=0, initializer_range=INIT_STD,
    )  # fmt: skip
    llama = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, rope_theta=500000.0, rms_norm_eps=1e-5, vocab_size=256,
        max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        initializer_range=INIT_STD,
    )  # fmt: skip
    attention = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, initializer_range=INIT_STD, rms_norm_eps=1e-5,
    )  # fmt: skip
    mixtral = MixtralConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
        **attention,
    )  # fmt: skip
    qwen2_moe = Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **attention,
    )  # fmt: skip
    # a dense leading layer (mlp_only_layers, jaxmeg's moe.first_dense) before two MoE ones
    qwen2_moe_dense = Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        **{**attention, "num_hidden_layers": 3},
    )  # fmt: skip
    # MoE every other layer (decoder_sparse_step 2): dense, MoE, dense, MoE (jaxmeg's moe.every)
    qwen2_moe_every2 = Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
        **{**attention, "num_hidden_layers": 4},
    )  # fmt: skip
    # MoE, dense, MoE, dense (mlp_only_layers 1 and 3: jaxmeg's moe.pattern, a unit that
    # starts with its MoE layer, which first_dense and every cannot say)
    qwen2_moe_pattern = Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1, 3],
        **{**attention, "num_hidden_layers": 4},
    )  # fmt: skip
    return {
        "gpt2": (GPT2LMHeadModel(gpt2), "float16"),
        "llama_gqa": (LlamaForCausalLM(llama), "bfloat16"),
        "mixtral": (MixtralForCausalLM(mixtral), "bfloat16"),
        "qwen2_moe": (Qwen2MoeForCausalLM(qwen2_moe), "bfloat16"),
        "qwen2_moe_dense": (Qwen2MoeForCausalLM(qwen2_moe_dense), "bfloat16"),
        "qwen2_moe_every2": (Qwen2MoeForCausalLM(qwen2_moe_every2), "bfloat16"),
        "qwen2_moe_pattern": (Qwen2MoeForCausalLM(qwen2_moe_pattern), "bfloat16"),
    }


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "hf"))
    parser.add_argument("--only", nargs="*", help="fixture names to write (default: all)")
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    for name, (model, dtype) in _models().items():
        if args.only and name not in args.only:
            continue
        model = model.eval()
        with torch.no_grad():  # biases, norms and routers start at 0 and 1 (or 0): make them count
            for pname, param in model.named_parameters():
                if param.ndim == 1 or pname.endswith("gate.weight"):
                    param.add_(0.1 * torch.randn_like(param))
        model = model.to(getattr(torch, dtype))
        out = Path(args.out) / name
        model.save_pretrained(out, safe_serialization=True)
        # Reloaded rather than cast back: a cast would keep buffers rounded to 16 bits (Llama's
        # rotary frequencies), which the checkpoint does not hold.
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().numpy()
        np.savez_compressed(
            out / "reference.npz", input_ids=ids.numpy().astype(np.int32), logits=logits
        )
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{out}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
