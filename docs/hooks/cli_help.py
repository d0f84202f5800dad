"""MkDocs hook: the command-line flags page written from the parser itself, so the reference
is what ``python -m hpcpar COMMAND --help`` prints and cannot fall behind it."""

from __future__ import annotations

import os

PAGE = "reference/flags.md"
MARK = "<!-- every command's --help: docs/hooks/cli_help.py -->"


def every_help() -> str:
    """Each command's ``--help``, in the order of ``python -m hpcpar --help``, at 100 columns."""
    os.environ["COLUMNS"] = "100"                  # argparse wraps to the terminal's width
    from hpcpar.jobs.parser import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    parts = [f"## hpcpar\n\n```\n{parser.format_help()}```\n"]
    for name, sub in commands.items():
        parts.append(f"## {name}\n\n```\n{sub.format_help()}```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARK not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARK!r}: the flags have nowhere to go")
    return markdown.replace(MARK, every_help())
