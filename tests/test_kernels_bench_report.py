"""`kvsieve bench decode` pieces that need no GPU: variant parsing, the markdown table and the plot."""

from __future__ import annotations

import json

import pytest

from kvsieve.bench.decode import VARIANTS, parse_variant, register_variant
from kvsieve.bench.report import markdown, write_results


def _row(variant, n, us, graph_us, **extra):
    return {"shape": "llama-3.1-8b", "heads": 32, "kv_heads": 8, "head_dim": 128, "n": n, "batch": 1,
            "variant": variant, "median_us": us, "graph_us": graph_us, "gb_per_s": 1000.0, "floor_us": 10.0,
            "fraction_of_floor": 10.0 / us, "v_row_fraction": 1.0, "launches": 2, "rel_error_vs_sdpa": 1e-3,
            "host_us": 40.0, **extra}


def _results():
    return {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-22 08:00:00 UTC", "torch": "2.11", "triton": "3.6.0",
            "flashinfer": "0.5.3", "dtype": "bfloat16", "protocol": "cold L2", "copy_bandwidth_bytes_per_s": 3e12,
            "rows": [_row("flashinfer", 4096, 22.0, 21.0, speedup_vs_flashinfer=1.0, graph_speedup_vs_flashinfer=1.0),
                     _row("santa-prop:128", 4096, 11.0, 10.5, speedup_vs_flashinfer=2.0,
                          graph_speedup_vs_flashinfer=2.0),
                     _row("flashinfer", 8192, 30.0, 29.0), {**_row("dense", 8192, 1, 1), "error": "boom"}]}


def test_parse_variant():
    assert parse_variant("dense") == ("dense", None)
    assert parse_variant("santa-prop:128") == ("santa-prop", 128)
    with pytest.raises(ValueError, match="budget"):
        parse_variant("santa-flash")
    with pytest.raises(ValueError, match="takes no budget"):
        parse_variant("dense:128")
    with pytest.raises(ValueError, match="variant"):
        parse_variant("flash-attn")
    with pytest.raises(ValueError, match="variant"):
        parse_variant("santa-prop-v7:128")  # historical paths are gone


def test_variants_are_the_peers_and_the_methods_gpu_paths(monkeypatch):
    assert sorted(VARIANTS) == ["dense", "flashinfer", "santa-flash", "santa-prop", "sdpa"]
    assert {name for name, v in VARIANTS.items() if v.peer} == {"flashinfer", "sdpa"}
    monkeypatch.setattr("kvsieve.bench.decode.VARIANTS", dict(VARIANTS))
    from kvsieve.bench import decode

    @register_variant("toy-method", budget=True)
    def _toy(x, budget, seed):
        return (lambda: x.q), None
    assert decode.parse_variant("toy-method:4") == ("toy-method", 4)


def test_report_files(tmp_path):
    text = markdown(_results(), "kvsieve bench decode")
    assert "| 4,096 | santa-prop:128 | 11.0 | 2.00x | 10.5 | 2.00x |" in text
    assert "error: boom" in text
    paths = write_results(_results(), tmp_path, "x", "kvsieve bench decode")
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert json.loads(paths[0].read_text())["command"] == "kvsieve bench decode"
    assert paths[2].stat().st_size > 1000
