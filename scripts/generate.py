"""Generate tokens from a run directory's newest checkpoint, with a key/value cache.

python scripts/generate.py --out runs/a --prompt "def main(" --max-new-tokens 40
python scripts/generate.py --out runs/a --prompt-ids 1,2,3 --max-new-tokens 8 --temperature 0.8 \\
    --top-k 40 --seed 1
python scripts/generate.py --out runs/a --prompt "import" --max-new-tokens 20 \\
    --cpu-devices 4 --set parallel.tensor=4      # tensor-parallel, the same ids as one device

Prints the prompt and its continuation as text when the run has a tokenizer (`data.tokenizer`,
else its data's; always
for --prompt), then, last, one JSON line {"ids": [the new ids, prompt excluded]}. The config is
RUN_DIR/config.yaml if present, else the one the newest checkpoint was saved with; --set changes
it (the mesh: parallel.tensor; data and pipe stay 1). --temperature 0 (the default) is greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.run_directory_parser(__doc__)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the run's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, required=True, metavar="N")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); else sample"
    )
    parser.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    return parser.parse_args(argv)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line's numbers and paths (before jax starts), or None."""
    if cli.run_directory_problem(args):
        return cli.run_directory_problem(args)
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if args.temperature < 0:
        return f"--temperature must be >= 0 (0 = greedy), got {args.temperature}"
    if args.top_k < 0:
        return f"--top-k must be >= 0 (0 = all tokens), got {args.top_k}"
    return None


def run(args: argparse.Namespace) -> list[int]:
    from jaxmeg.data import load_tokenizer
    from jaxmeg.parallel.mesh import mesh_words
    from jaxmeg.training import evaluation, generation
    from jaxmeg.training.run_log import say

    prompt = parse_ids(args.prompt_ids) if args.prompt is None else None
    cfg = evaluation.run_config(args.out, args.overrides)
    path = generation.tokenizer_path(cfg)
    tokenizer = load_tokenizer(path) if path else None
    if prompt is None:
        if tokenizer is None:
            raise ValueError(
                f"the run in {args.out} has no tokenizer to encode --prompt with (data.tokenizer "
                f"is {cfg.data.tokenizer or 'unset'} and its data names none); pass --prompt-ids"
            )
        prompt = tokenizer.encode(args.prompt).ids
    trainable = evaluation.inference_trainable(cfg)
    generation.check_request(trainable, len(prompt), args.max_new_tokens,
                             args.temperature, args.top_k)  # fmt: skip
    step, params = evaluation.restore_params(trainable, args.out)
    say(f"step {step} of {args.out} on mesh {mesh_words(trainable.mesh)}")
    new = generation.generate(
        trainable, params, prompt, args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, seed=args.seed,
    ).tolist()  # fmt: skip
    if tokenizer is not None:
        print(tokenizer.decode(prompt + new))
    print(json.dumps({"ids": new}))
    return new


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := cli.begin(check_args(args), args.cpu_devices)) is not None:
        return code
    return cli.run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
