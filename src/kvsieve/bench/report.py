"""Results of ``kvsieve bench decode``: JSON, a markdown table and a latency-vs-context PNG; the file
writing and the per-context plot that ``kvsieve bench e2e`` uses too."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def library_version(module: str) -> str | None:
    """The version of the importable ``module`` (its ``__version__``, else its distribution's); None where it is
    not installed or does not import."""
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a library that fails to import has no version to report
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(module)
        except PackageNotFoundError:
            return None


def environment(kind: str, device, dtype) -> dict:
    """The fields every results file opens with: its kind, the UTC date, the device's name, the library versions
    (torch, transformers, triton) and the dtype."""
    import time

    import torch

    device = torch.device(device)
    return {"kind": kind, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": library_version("transformers"),
            "triton": library_version("triton"), "dtype": str(dtype).removeprefix("torch.")}


def fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec``, or a dash for a missing value."""
    return "—" if value is None else format(value, spec)


def markdown(results: dict, command: str) -> str:
    lines = [
        f"# Decode-step attention benchmark — {results['device']}",
        "",
        f"- date: {results['date']}; torch {results['torch']}, triton {results['triton']}, "
        f"FlashInfer {results['flashinfer']}; {results['dtype']}",
        f"- command: `{command}`",
        f"- protocol: {results['protocol']}",
        f"- inputs: {results.get('inputs', 'i.i.d. Gaussian')}",
        f"- attention: {results.get('attention', 'uniform')} (calibration and each case's profile below; V rows = "
        "the fraction of V rows a sampling method read, its density)",
        f"- bandwidth ceiling (device-to-device copy, read + write): "
        f"{results['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; floor = bytes the method must touch / ceiling",
        "- bytes: dense = all of K and V; S²ANTA = all of K + the V rows sampled by any head of a GQA group "
        "(measured on the same inputs); the prop stash and partials are not counted",
        "",
    ]
    rows = results["rows"]
    groups = sorted({(r["shape"], r["batch"]) for r in rows}, key=lambda g: (g[0], g[1]))
    for shape, batch in groups:
        sel = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
        head = sel[0]
        lines.append(f"## {shape} (H={head['heads']}, Hkv={head['kv_heads']}, d={head['head_dim']}), batch {batch}")
        lines.append("")
        lines.append("| n | variant | µs | speedup vs FlashInfer | graph µs | graph speedup | GB/s | floor µs "
                     "| of floor | V rows | launches | rel err vs SDPA |")
        lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(sel, key=lambda r: (r["n"], r["variant"])):
            if "error" in r:
                lines.append(f"| {r['n']:,} | {r['variant']} | error: {r['error'][:80]} | | | | | | | | | |")
                continue
            lines.append(
                f"| {r['n']:,} | {r['variant']} | {r['median_us']:.1f} | {fmt(r.get('speedup_vs_flashinfer'), '.2f')}x"
                f" | {fmt(r.get('graph_us'), '.1f')} | {fmt(r.get('graph_speedup_vs_flashinfer'), '.2f')}x"
                f" | {r['gb_per_s']:.0f} | {r['floor_us']:.1f} | {r['fraction_of_floor']:.0%} "
                f"| {r['v_row_fraction']:.2%} | {fmt(r.get('launches'), 'd')} | {r['rel_error_vs_sdpa']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines + attention_lines(results))


def attention_lines(results: dict) -> list[str]:
    """The decode bench's attention: calibration per shape and the profile measured on each case's inputs."""
    from .peaked import calibration_markdown

    lines = [line for shape, cal in results.get("calibration", {}).items() for line in calibration_markdown(cal, shape)]
    profiles = results.get("attention_profiles") or {}
    if profiles:
        cols = ("entropy", "top1", "top5", "sink", "window64", "window256", "keys90")
        lines += [f"Attention profile of each case's inputs ({results.get('attention', 'uniform')}; the query at the "
                  "last position, mean over rows and heads):", "", "| case | " + " | ".join(cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        lines += [f"| {case} | " + " | ".join(f"{prof[c]:.3f}" for c in cols) + " |" for case, prof in profiles.items()]
        lines.append("")
    return lines


def plot(results: dict, path: Path) -> None:
    plot_by_context(results, path, "median_us", "context n (keys)", "µs per decode step (cold L2, median)")


def plot_by_context(results: dict, path: Path, value: str, xlabel: str, ylabel: str) -> None:
    """One panel per (shape, batch): ``value`` of each variant against the context, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if value in r]
    groups = sorted({(r["shape"], r["batch"]) for r in rows})
    variants = sorted({r["variant"] for r in rows})
    # one colour per variant across panels, and one legend under them, so that no legend hides a point
    cmap = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    colours = {v: cmap(i % cmap.N) for i, v in enumerate(variants)}
    legend_rows = (len(variants) + 1) // 2
    height = 4.5 + 0.22 * legend_rows
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), height), squeeze=False)
    handles = {}
    for ax, (shape, batch) in zip(axes[0], groups, strict=False):
        sel = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
        for variant in sorted({r["variant"] for r in sel}):
            pts = sorted((r["n"], r[value]) for r in sel if r["variant"] == variant)
            (handles[variant],) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant,
                                          color=colours[variant])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{shape}, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{results['device']} — {results['date']}")
    bottom = 0.22 * legend_rows / height + 0.02
    if handles:
        fig.legend([handles[v] for v in variants if v in handles], [v for v in variants if v in handles],
                   loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: dict, out_dir: Path | str, stem: str, command: str,
                  to_markdown: Callable[[dict, str], str] = markdown,
                  to_plot: Callable[[dict, Path], object] = plot) -> list[Path]:
    """``<stem>.json``, ``.md`` (``to_markdown``) and ``.png`` (``to_plot``; left out when it returns False)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = dict(results, command=command)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(results, indent=1, default=str))
    paths[1].write_text(to_markdown(results, command))
    if to_plot(results, paths[2]) is False:
        paths.pop()
    return paths
