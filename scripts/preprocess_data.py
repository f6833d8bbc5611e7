"""Turn text or JSONL files into a token file for training.

  python scripts/preprocess_data.py --input a.txt b.jsonl --output-prefix data/corpus \
      --vocab-size 32000
  python scripts/preprocess_data.py --input c.jsonl --output-prefix data/c \
      --tokenizer tokenizer.json     # or a directory: an HF model's, an imported run's

A .txt file is one document; a .jsonl file has one document per line in the `--text-key` field.
Writes PREFIX.bin, PREFIX.idx.npy, PREFIX.json (and PREFIX.tokenizer.json when it trains a BPE).
Train on it with `--set data.dataset=PREFIX`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def output_problem(prefix: str, overwrite: bool) -> str | None:
    """What keeps the token file from being written at `prefix`, or None: runs that trained
    on an existing PREFIX would read other data if it were replaced without --overwrite."""
    from jaxmeg import paths
    from jaxmeg.data.corpus import output_prefix
    from jaxmeg.data.token_file import existing_files

    if not prefix.strip():
        return "--output-prefix is empty; give a path prefix"
    target = output_prefix(prefix)
    problem = paths.directory_problem(str(target.parent), "--output-prefix")
    if problem:
        return problem
    existing = existing_files(target)
    if existing and not overwrite:
        return (
            f"--output-prefix {prefix}: {existing[0]} already exists (runs that trained on it "
            f"would read other data); pass --overwrite to replace it, or give another prefix"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    parser.add_argument(
        "--output-prefix", required=True,
        help="PREFIX of the files written; a directory (or a path ending in /) gets DIR/tokens.*",
    )  # fmt: skip
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer",
        help="an existing tokenizer.json, or a directory holding one (a Hugging Face model, a run "
        "that scripts/convert_hf.py imported); documents end with its end-of-text token",
    )
    tok.add_argument("--vocab-size", type=int, default=32000, help="train a byte-level BPE")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the files of an existing PREFIX"
    )
    args = parser.parse_args(argv)
    from jaxmeg import cli

    if code := cli.begin(output_problem(args.output_prefix, args.overwrite), devices=False):
        return code
    from jaxmeg.data import prepare_dataset

    try:
        info = prepare_dataset(
            args.input,
            args.output_prefix,
            tokenizer_json=args.tokenizer,
            vocab_size=args.vocab_size,
            text_key=args.text_key,
            show_progress=not args.no_progress,
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rate = info["num_tokens"] / max(info["seconds"], 1e-9)
    print(
        f"{info['prefix']}: {info['num_docs']} documents, {info['num_tokens']:,} tokens, "
        f"vocabulary {info['vocab_size']}, {rate:,.0f} tokens/s"
    )
    if args.tokenizer is None and info["vocab_size"] < args.vocab_size:
        print(
            f"note: the BPE stopped at {info['vocab_size']} tokens of the --vocab-size "
            f"{args.vocab_size} asked: the text has no more merges to learn",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
