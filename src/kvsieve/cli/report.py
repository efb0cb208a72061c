"""``kvsieve report DIR [--migrate]``: plots and report.md for an eval results folder."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write PNG plots and report.md for a kvsieve eval results folder")
    p.add_argument("results", help="the folder given to kvsieve eval --output")
    p.add_argument("--migrate", action="store_true",
                   help="first move a folder of one JSON file per cell (format version 1) into its "
                        "cells.sqlite database, checking every cell, then delete the cell files")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..eval.report import print_table, summarize, write_report_with_notes
    from ..eval.store import ResultStore, migrate_folder

    if args.migrate:
        done = migrate_folder(args.results)
        if done.cells:
            print(f"migrated {done.cells} cells into {args.results}/cells.sqlite; removed {done.removed} files")
        else:
            print(f"{args.results} already keeps its cells in cells.sqlite; nothing to migrate")
    path, notes = write_report_with_notes(args.results)
    print_table(summarize(ResultStore.open_existing(args.results).rows()), title=f"kvsieve report — {args.results}")
    print(f"wrote {path} and its plots")
    for note in notes:
        print(note)
    return 0
