"""`prove-local convert HF_DIR -o OUT.gguf`: the converter's command line."""
from __future__ import annotations

import argparse
import signal
import sys

from .errors import ConvertError
from .export import OUTTYPES, ROLES, convert_checkpoint


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert", help="convert a Hugging Face Qwen2/Qwen3/MARS checkpoint to GGUF",
        description="Convert a Hugging Face Qwen2 / Qwen2.5 / Qwen3 checkpoint (or a MARS a2d-* proposer) "
                    "to one GGUF file for llama.cpp.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory (config.json, tokenizer, safetensors)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="output file")
    p.add_argument("--outtype", choices=OUTTYPES, default="f16",
                   help="tensor type (default f16; K-quants go through llama.cpp's quantizer)")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="default: proposer if the tokenizer has a mask token, else verifier")
    p.add_argument("--block-size", type=int, default=16, help="proposal block size stored as prove.block_size")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # unwinds through the converter's temp-file cleanup


def run(args: argparse.Namespace) -> int:
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        out = convert_checkpoint(args.hf_dir, args.output, outtype=args.outtype, role=args.role,
                                 block_size=args.block_size, progress=not args.quiet)
    except (ConvertError, OSError) as e:
        print(f"prove-local convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prove-local convert: interrupted; no output written", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(out)
    return 0
