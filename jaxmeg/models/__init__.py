"""Single-device model code; logical axis names only, no mesh."""

from jaxmeg.models.gpt import GPT, Block, BlockStack, Embed, Head, SequenceOrder, no_constraint
from jaxmeg.models.loss import cross_entropy

__all__ = [
    "GPT", "Block", "BlockStack", "Embed", "Head", "SequenceOrder", "cross_entropy",
    "no_constraint",
]  # fmt: skip
