"""`python -m tfjax.data.tokenizer train INPUT... --output DIR --vocab_size V [--field text]
[--min_frequency N]`

Trains a byte-level BPE tokenizer (the `tokenizers` library) on the documents of INPUT
(files, globs or directories; `.jsonl` / `.json` lines give their --field, any other file
is one document) and writes DIR/tokenizer.json and DIR/tokenizer_config.json: DIR is a
tokenizer for `--config.data.tokenizer=DIR` and transformers' `AutoTokenizer`. Progress
goes to stderr; bad input is one line (exit status 2). See docs/data.md ("Tokenizers").
"""

from __future__ import annotations

import argparse
import sys

from tfjax.data.tokenizer.train import train

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfjax.data.tokenizer")
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("train", help="train a byte-level BPE tokenizer on a corpus")
    t.add_argument("inputs", nargs="+", metavar="INPUT", help="files, globs or directories")
    t.add_argument("--output", required=True, help="the tokenizer directory to write")
    t.add_argument("--vocab_size", type=int, required=True, help="ids, specials included")
    t.add_argument("--field", default="text", help="the jsonl field that holds the text")
    t.add_argument("--min_frequency", type=int, default=2,
                   help="a pair merges only if it occurs at least this often")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="the progress bar")
    args = parser.parse_args(argv)
    try:
        train(args.inputs, args.output, args.vocab_size, field=args.field,
              min_frequency=args.min_frequency, progress=args.progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
