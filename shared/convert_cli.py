"""`kaiten convert`: make sure a model directory exists (the default SmolLM2 or a GGUF file
converted once, a Hugging Face repo found in the local cache) and print it; or convert one GGUF
file into a given folder (--gguf, --out)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from shared.gguf_convert import convert_gguf
from shared.model_source import resolve_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kaiten convert", description="Make sure a model directory exists: convert "
                                 "the default SmolLM2 or a GGUF file once, or find a Hugging Face repo in the "
                                 "local cache. Prints the model directory.")
    ap.add_argument("model", nargs="?", default=None,
                    help="a model directory, a GGUF file or a Hugging Face repo id in the local cache "
                         "(env KAITEN_MODEL; default: the default SmolLM2)")
    ap.add_argument("--models-dir", type=Path, default=None,
                    help="where converted models go (env KAITEN_MODELS_DIR, default ./models)")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="convert this GGUF file into --out (no cache, no marker)")
    ap.add_argument("--out", type=Path, default=None, help="output directory for --gguf")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KAITEN_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.gguf is not None and args.out is None:
        ap.error("--gguf needs --out")
    try:
        if args.gguf is not None:
            print(convert_gguf(args.gguf, args.out))
        else:
            print(resolve_model(args.model if args.model is not None else os.environ.get("KAITEN_MODEL", ""),
                                args.models_dir))
    except (ValueError, OSError) as e:    # ModelNotFoundError among them: a file it cannot serve says why
        print(f"kaiten convert: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
