"""Tokenizer, token files (jaxmeg's own and Megatron-LM's indexed dataset), the default corpus
and the deterministic loader (no jax here)."""

from jaxmeg.data.corpus import default_corpus_files, prepare_dataset, prepare_default_dataset
from jaxmeg.data.loader import BatchLoader, shard_rows
from jaxmeg.data.megatron_dataset import open_megatron_dataset, write_megatron_dataset
from jaxmeg.data.token_file import TokenFile, dataset_format, write_token_file
from jaxmeg.data.tokenizer import eot_id, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "BatchLoader",
    "TokenFile",
    "dataset_format",
    "default_corpus_files",
    "eot_id",
    "load_tokenizer",
    "open_megatron_dataset",
    "prepare_dataset",
    "prepare_default_dataset",
    "shard_rows",
    "train_bpe_tokenizer",
    "write_megatron_dataset",
    "write_token_file",
]
