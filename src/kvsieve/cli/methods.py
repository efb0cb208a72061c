"""``kvsieve methods``: the registered methods with their parameters."""

from __future__ import annotations

import argparse
import sys
import textwrap


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", help="list the methods and their parameters")
    p.add_argument("name", nargs="?", help="show one method only")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..core.registry import method_class, methods

    names = [args.name] if args.name else methods()
    classes = [method_class(name) for name in names]  # an unknown name fails before printing anything
    if sys.stdout.isatty():
        _print_tables(classes)
    else:
        # Piped or redirected: plain text, every choice and help text in full (a table would cut
        # them to the pipe's 80 columns with "…").
        sys.stdout.write(plain_text(classes))
    return 0


def plain_text(classes: list) -> str:
    lines: list[str] = []
    for cls in classes:
        lines.append(f"{cls.name} — {cls.summary}")
        rows = cls.config_class.parameters()
        if not rows:
            lines.append("    (no parameters)")
        for pname, ptype, default, help_text in rows:
            lines.append(f"    {pname}: {ptype} = {default}")
            lines.extend(textwrap.wrap(help_text, width=96, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                       break_long_words=False, break_on_hyphens=False))
        lines.append("")
    return "\n".join(lines)


def _print_tables(classes: list) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    for cls in classes:
        # Text objects are never parsed as markup: help texts keep their brackets ("[n]").
        table = Table(title=Text.assemble((cls.name, "bold"), f" — {cls.summary}"), title_justify="left")
        for column in ("parameter", "type", "default", "meaning"):
            # fold, never "…": a choice cut short is a choice the reader cannot type
            table.add_column(column, overflow="fold")
        rows = cls.config_class.parameters()
        for pname, ptype, default, help_text in rows:
            table.add_row(Text(pname), Text(ptype), Text(str(default)), Text(help_text))
        if not rows:
            table.add_row("(none)", "", "", "")
        console.print(table)
