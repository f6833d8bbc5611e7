"""The checkpoint policies of `model.remat` (`REMAT_POLICY`): what a layer's forward keeps for
its backward, and what the backward recomputes."""

from __future__ import annotations

import jax

from jaxmeg.models.parts import keeping_stacked_parts

_MATMUL_PRIMITIVES = frozenset({"dot_general", "dot_product_attention_fwd_wrapper"})


def save_matmul_outputs(prim, *_, **__) -> bool:
    """Checkpoint policy: saves the outputs of every matmul, `dot_general` and cuDNN's fused
    attention forward (whose backward reads its output and softmax statistics); everything
    else is recomputed. The layer's input, the checkpointed function's argument, is kept too."""
    return prim.name in _MATMUL_PRIMITIVES


def save_flash_attention(prim, *_, **__) -> bool:
    """Checkpoint policy: saves cuDNN's fused attention forward's outputs (the attention output
    and its softmax statistics, all its backward reads). Flash attention stores no s x s
    scores, so keeping them is Megatron-LM's selective recompute on a GPU; without it the
    backward reruns the forward kernel."""
    return prim.name == "dot_product_attention_fwd_wrapper"


REMAT_POLICY = {
    # Recompute no matmul, and nothing the backward can rebuild cheaply: keep the layer's input
    # and the matmul outputs its backward reads (QKV and fc1 before their biases, the attention
    # scores before scaling and masking, the attention context, the out-projection before its
    # bias and residual add; fc2's output is read by nothing). The backward recomputes the
    # elementwise work from them: the layer norms and their statistics, biases, rotary, the
    # causal mask (it depends on no input), softmax, tanh-GeLU and its output (fc2's input),
    # the residual adds. A GPT layer keeps s b h (2 + 8 / t) + a s^2 b / t elements, instead of
    # every intermediate (45 s b h on gpt_tiny), and its backward's matmuls are exactly the
    # forward's input and weight gradients.
    "none": keeping_stacked_parts(save_matmul_outputs),
    # Keep matmuls against weights, recompute attention scores/softmax (Megatron's selective);
    # cuDNN's attention keeps its output and statistics (it has no scores to recompute).
    "selective": keeping_stacked_parts(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable, save_flash_attention
        )
    ),
    # Keep nothing inside the layer but its input.
    "full": jax.checkpoint_policies.nothing_saveable,
}
