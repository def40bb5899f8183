#!/usr/bin/env python3
"""Build a tiny random-weight model (Llama, or a sliding-window or GDN hybrid) and its local tokenizer.

Usage: tools/make_tiny_model.py DIR [--seed N] [--arch llama|sliding|gdn]   (same as `pdxfer make-tiny-model DIR`)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdxfer.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["make-tiny-model", *sys.argv[1:]]))
