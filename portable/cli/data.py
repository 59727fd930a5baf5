"""`portable data tokenize TEXT --tokenizer bytes|DIR --out FILE` and `portable data inspect FILE`.

`tokenize` makes the token file `portable train --data` reads from any text file, offline
(portable/jobs/tokenize.py); an existing FILE is replaced only with `--force` (else exit 5).
`inspect` shows a token file's dtype, token count, largest id and fingerprint, and with
`--seq` how many windows (samples) it holds and, with `--batch` too, the steps per epoch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..jobs.data import Sampler, TokenFile
from ..jobs.tokenize import tokenize
from .exit_codes import EPILOG, ExitCode, OutputConflictError

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "data",
        parents=parents,
        help="make and inspect token files for training (portable data tokenize | inspect)",
        description="Token files for training: `tokenize` turns a text file into one, "
        "`inspect` describes one.",
    )
    actions = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    t = actions.add_parser(
        "tokenize",
        parents=parents,
        help="tokenize a text file into a token file (.bin or .npy)",
        description="Tokenize TEXT into FILE, a flat array of token ids (.bin raw little-endian, "
        "or .npy): uint16 when the vocabulary fits, else uint32. Nothing is downloaded.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("text", type=Path, metavar="TEXT", help="a text file (UTF-8 for DIR)")
    t.add_argument(
        "--tokenizer",
        required=True,
        metavar="bytes|DIR",
        help="`bytes` (UTF-8 bytes as ids 0..255, end of text 0) or a local directory holding a "
        "Hugging Face tokenizer.json",
    )
    t.add_argument("--out", "-o", type=Path, required=True, metavar="FILE", help=".bin or .npy")
    t.add_argument("--dtype", choices=("uint16", "uint32"), default=None, help="default: auto")
    t.add_argument("--no-eos", action="store_true", help="append no end-of-text id")
    t.add_argument("--force", action="store_true", help="replace an existing FILE")
    t.add_argument("--json", action="store_true", help="print one JSON document")
    t.set_defaults(run=run_tokenize)
    i = actions.add_parser(
        "inspect",
        parents=parents,
        help="describe a token file",
        description="Show a token file's dtype, tokens, largest id and fingerprint (reads it "
        "once), and with --seq the windows of seq + 1 tokens it holds.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("file", type=Path, metavar="FILE", help=".bin, .npy or a datasets directory")
    i.add_argument("--dtype", choices=("uint16", "uint32"), default=None, help=".bin ids")
    i.add_argument("--seq", type=_positive_int, default=None, help="sequence length")
    i.add_argument("--batch", type=_positive_int, default=None, help="global batch (with --seq)")
    i.add_argument("--json", action="store_true", help="print one JSON document")
    i.set_defaults(run=run_inspect)


def run_tokenize(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        raise OutputConflictError(
            f"{args.out} exists", fix="pass --force to replace it, or choose another --out"
        )
    result = tokenize(
        args.text, args.tokenizer, args.out, dtype=args.dtype, append_eos=not args.no_eos
    )
    if args.json:
        print(json.dumps({"status": "ok", "exit_code": 0, **result}, indent=2))
    else:
        eos = "no end-of-text id" if result["eos"] is None else f"end-of-text id {result['eos']}"
        print(
            f"wrote {result['out']}: {result['tokens']} tokens ({result['dtype']}, vocabulary "
            f"{result['vocab']}, {eos}) from {result['text_bytes']} bytes of {result['text']}"
        )
    return ExitCode.OK


def run_inspect(args: argparse.Namespace) -> int:
    tokens = TokenFile.open(args.file, dtype=args.dtype)
    doc: dict[str, Any] = {**tokens.identity(), "max_token": tokens.max_token()}
    if args.seq is not None:
        doc["seq"] = args.seq
        doc["windows"] = (len(tokens) - 1) // args.seq
        if args.batch is not None:
            Sampler(tokens, batch=args.batch, seq=args.seq, seed=0)  # the same checks as train
            doc["batch"] = args.batch
            doc["steps_per_epoch"] = doc["windows"] // args.batch
    if args.json:
        print(json.dumps({"status": "ok", "exit_code": 0, **doc}, indent=2))
        return ExitCode.OK
    lines = [
        f"{doc['path']}: {doc['tokens']} tokens, {doc['dtype']} ({doc['bytes']} bytes)",
        f"  largest id {doc['max_token']} (a model needs a vocabulary of {doc['max_token'] + 1})",
        f"  fingerprint {doc['fingerprint']}",
    ]
    if "windows" in doc:
        lines.append(f"  {doc['windows']} windows of seq + 1 = {args.seq + 1} tokens")
    if "steps_per_epoch" in doc:
        lines.append(
            f"  {doc['steps_per_epoch']} steps per epoch at a global batch of {args.batch}"
        )
    print("\n".join(lines))
    return ExitCode.OK


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
