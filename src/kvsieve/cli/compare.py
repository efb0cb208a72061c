"""``kvsieve compare DIR A B``: paired differences between two methods of one eval results folder."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="paired A − B per (task, length) with 95%% bootstrap CIs, "
                                       "for two methods of one kvsieve eval results folder",
                       description="Paired A − B per (task, length) over the prompts both methods ran, with 95%% "
                       "bootstrap CIs; a '*' marks a difference whose CI excludes 0.")
    p.add_argument("results", help="the folder given to kvsieve eval --output")
    p.add_argument("a", help="method spec A (as in the folder's summary, or any spelling of it, or a method "
                             "name alone when the folder holds one spec of that method)")
    p.add_argument("b", help="method spec B")
    p.add_argument("--metrics", default="score,kl_mean,top1_agree",
                   help="comma list of: score, kl_mean, top1_agree, kl_answer, top1_answer, rel_error, "
                        "density, kv_density (default score,kl_mean,top1_agree)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead of a terminal table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..eval.compare import STAR_NOTE, compare_methods, comparison_table, resolve_method
    from ..eval.report import markdown_text_table, print_text_table
    from ..eval.store import ResultStore

    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    rows = ResultStore.open_existing(args.results).rows()
    present = sorted({r["method"] for r in rows})
    a, b = resolve_method(args.a, present), resolve_method(args.b, present)
    header, body = comparison_table(compare_methods(rows, a, b, metrics=metrics), metrics)
    if args.markdown:
        print(f"A = {a}  \nB = {b}\n")
        print(markdown_text_table(header, body))
    else:
        print_text_table(header, body, f"A = {a}\nB = {b}")
    print(STAR_NOTE)
    return 0
