"""Write docs/from-easyr1.md's key table from vlgrpo.from_easyr1.RULES (the converter's own mapping).

    python scripts/easyr1_table.py            # rewrites the part between the page's table markers
    python scripts/easyr1_table.py --check    # exit 1 if the page differs (tests/test_from_easyr1.py checks it too)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlgrpo.from_easyr1 import TABLE_END, TABLE_START, table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "from-easyr1.md"


def with_table(text: str) -> str:
    """The page with its generated table replaced by the current one."""
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"{PAGE} lacks the table markers:\n{TABLE_START}\n{TABLE_END}")
    head, rest = text.split(TABLE_START, 1)
    return head + table() + rest.split(TABLE_END, 1)[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the page is current")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    new = with_table(text)
    if args.check:
        sys.exit(0 if new == text else f"{PAGE} is out of date: python scripts/easyr1_table.py")
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
