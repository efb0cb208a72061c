"""``kvsieve methods``: the registered methods with their parameters."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", help="list the methods and their parameters")
    p.add_argument("name", nargs="?", help="show one method only")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..core.registry import method_class, methods

    names = [args.name] if args.name else methods()
    console = Console()
    for name in names:
        cls = method_class(name)
        table = Table(title=f"[bold]{name}[/bold] — {cls.summary}", title_justify="left", show_lines=False)
        table.add_column("parameter")
        table.add_column("type")
        table.add_column("default")
        table.add_column("meaning")
        for pname, ptype, default, help_text in cls.config_class.parameters():
            table.add_row(pname, ptype, str(default), help_text)
        if not cls.config_class.parameters():
            table.add_row("(none)", "", "", "")
        console.print(table)
    return 0
