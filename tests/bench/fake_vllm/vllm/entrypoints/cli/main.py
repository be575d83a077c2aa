"""`python -m vllm.entrypoints.cli.main serve ...` of the stand-in package: hands the argv to deltaserve's CLI."""

from __future__ import annotations

import sys

from deltaserve.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
