"""`fivefold prepare`: tokenise text files into the token shards that training reads."""

from __future__ import annotations

import argparse
import sys
import time

from fivefold.commands.args import positive_int
from fivefold.data.dataset import DataError, prepare


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare", help="tokenise text files into token shards for training",
        description="Tokenise .txt/.md (one document per file), .jsonl (one document per line, field "
                    "\"text\") and .parquet (column \"text\") files into token shards for "
                    "--set data.dataset=DIR. Re-running with unchanged inputs returns at once.")
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="PATH",
                   help="files or directories (searched recursively); repeatable")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                     help="encode with this Hugging Face tokenizer.json instead of training one")
    tok.add_argument("--vocab-size", type=positive_int, default=4096,
                     help="train a byte-level BPE of this size on the training split (default 4096)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="fraction of documents held out for validation, chosen by a hash of their text")
    p.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    if args.tokenizer is None and args.vocab_size < 257:
        raise DataError(f"--vocab-size={args.vocab_size} is too small for a byte-level BPE; use at least 257 "
                        f"(e.g. 4096)")
    start = time.perf_counter()
    index = prepare(args.input, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                    vocab_size=args.vocab_size)
    seconds = time.perf_counter() - start
    state = "already up to date" if index["reused"] else "written"
    print(f"{args.out}: {state} in {seconds:.1f} s  (dtype {index['dtype']}, vocab {index['vocab_size']}, "
          f"eos id {index['eos_id']})")
    for split, info in index["splits"].items():
        print(f"  {split:5s} {info['documents']:>10,d} documents {info['tokens']:>14,d} tokens "
              f"in {len(info['shards'])} shard(s)")
    if index["splits"]["val"]["tokens"] == 0:
        print("  warning: the validation split is empty (too few documents); training needs one: raise "
              "--val-fraction or split the text into more documents (e.g. .jsonl, one per line)", file=sys.stderr)
    return 0
