#!/usr/bin/env python3
"""Build the tiny random-weight Llama + local tokenizer used by tests, demos and benchmarks.

Usage: tools/make_tiny_model.py DIR [--seed N]   (same as `pdxfer make-tiny-model DIR`)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdxfer.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["make-tiny-model", *sys.argv[1:]]))
