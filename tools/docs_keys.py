"""Writes the documentation's "Every recipe key" page, ``docs/reference/keys.md``, from the schema.

``python tools/docs_keys.py`` rewrites the page; ``--check`` exits 1 where the committed page is not what the schema
gives (``tests/test_key_reference.py`` checks the same, so the page cannot fall behind a key).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kfacflow.key_reference import markdown  # noqa: E402 - after the path

PAGE = ROOT / "docs" / "reference" / "keys.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare the committed page with the schema's")
    args = parser.parse_args(argv)
    text = markdown()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(
                f"error: {PAGE.relative_to(ROOT)} is not the schema's: run python tools/docs_keys.py", file=sys.stderr
            )
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
