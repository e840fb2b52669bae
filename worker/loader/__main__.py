"""`python -m worker.loader NAME|FILE.gguf|DIR`: build the model's directory, print its path.

Progress goes to stderr, the path alone to stdout (CI and the benchmarks capture it).
"""

from __future__ import annotations

import sys

from worker.loader.builtin import MODEL_NAMES, resolve_model


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m worker.loader {'|'.join(MODEL_NAMES)}|FILE.gguf|DIR",
              file=sys.stderr)
        return 2
    try:
        print(resolve_model(argv[0]))
    except (ValueError, RuntimeError) as exc:
        print(f"radixray: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
