"""Writes a benchmark's figures into its own block of a page of docs/benchmarks/.

Each script owns the block between `<!-- bench: NAME -->` and `<!-- /bench: NAME -->` and
replaces only that, so scripts can be rerun one at a time; which page and section a block
belongs to is registered in benchmarks/runner/pages.py.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from benchmarks.runner.pages import DOCS, insert_into_section, place_of

REPO = Path(__file__).resolve().parents[2]


def command_as_run() -> str:
    """The running script's command line, as a block says how to reproduce it: `python
    benchmarks/…/script.py` and its arguments."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])  # quoted where an argument has spaces


def block_parser(page: str, runs: int, quick: str = "tiny model, one run: checks the script only"
                 ) -> argparse.ArgumentParser:
    """The arguments every block-writing script takes: --quick, --runs and --doc (the folder whose
    `page` gets the block); the script adds its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--doc", type=Path, default=None, help=f"write the block into this folder's {page} "
                                                               "(default: docs/benchmarks/, not with --quick)")
    return parser


def write_block(name: str, markdown: str, docs: Path = DOCS) -> None:
    """Block `name` replaced where it stands on its page, or, new there, added at the end of its
    section; a name benchmarks/runner/pages.py does not register is refused before anything is written."""
    page_name, section = place_of(name)
    page = docs / page_name
    start, end = f"<!-- bench: {name} -->", f"<!-- /bench: {name} -->"
    text = page.read_text() if page.exists() else ""
    block = f"{start}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else insert_into_section(text, section, block)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)


def write_block_and_say(name: str, markdown: str, docs: Path = DOCS) -> None:
    """write_block, then a line on stderr naming the page it went to."""
    write_block(name, markdown, docs)
    print(f"written to docs/benchmarks/{place_of(name)[0]}", file=sys.stderr)


def print_and_write_block(name: str, markdown: str, doc: Path | None, quick: bool) -> None:
    """The block printed, then written: into `doc`'s page where --doc names a folder, else into
    docs/benchmarks/ unless --quick (a script's check, whose figures are not the page's)."""
    print(markdown)
    docs = doc if doc is not None else (None if quick else DOCS)
    if docs is not None:
        write_block(name, markdown, docs)
