"""``benchmarks/breakdown/launch_sweep.py``'s host side: the ``--set`` syntax, the settings swept, the table."""

import pytest
from bench_scripts import load_bench


def load():
    return load_bench("breakdown/launch_sweep.py")


def test_set_parses_kernels_and_integer_settings():
    mod = load()
    got = mod.parse_settings("_a_kernel:num_warps=2,num_stages=3;_b_kernel:num_warps=8")
    assert got == {"_a_kernel": {"num_warps": 2, "num_stages": 3}, "_b_kernel": {"num_warps": 8}}
    assert mod.parse_settings("") == {}
    for bad in ("_a_kernel", "_a_kernel:num_warps", "_a_kernel:num_warps=two"):
        with pytest.raises(ValueError, match="--set"):
            mod.parse_settings(bad)


def test_settings_leave_out_the_launch_own():
    mod = load()
    got = mod.settings({"num_warps": 4, "num_stages": 2, "BLOCK": 64})
    labels = [label for label, _ in got]
    assert labels[0] == "default" and "warps=4" not in labels and "stages=2" not in labels
    assert {"warps=2", "warps=8", "stages=1", "stages=3", "stages=4"} <= set(labels)
    assert all(meta["BLOCK"] == 64 for _, meta in got)


def test_overrides_nest_and_restore():
    mod = load()
    with mod.overriding("_k", {"num_warps": 2}):
        with mod.overriding("_k", {"num_stages": 1}):
            assert mod._OVERRIDES["_k"] == {"num_warps": 2, "num_stages": 1}
        assert mod._OVERRIDES["_k"] == {"num_warps": 2}
    assert "_k" not in mod._OVERRIDES
    with mod.applying(mod.parse_settings("_k:num_warps=2;_j:num_stages=1")):  # --set's settings, spied
        assert mod._OVERRIDES == {"_k": {"num_warps": 2}, "_j": {"num_stages": 1}}
    assert mod._OVERRIDES == {}


def test_table_names_the_best_other_setting():
    mod = load()
    meta = {"device": "GPU", "date": "d", "torch": "t", "command": "c"}
    rows = [{"i": 0, "kernel": "_k", "setting": "default", "median_us": 10.0},
            {"i": 0, "kernel": "_k", "setting": "warps=2", "median_us": 8.0},
            {"i": 0, "kernel": "_k", "setting": "warps=8", "median_us": 12.0},
            {"i": 1, "kernel": "_w", "setting": "default", "skipped": "waits"}]
    text = mod.markdown(meta, [{"case": "1x8k", "method": "m", "call_us": {"median_us": 20.0}, "rows": rows,
                                "in_call": [{"kernel": "_k", "setting": "warps=2", "median_us": 19.0}]}])
    assert "| 1x8k | `m` | 20.0 | 0 | _k | 10.0 | warps=2 | 8.0 |" in text
    assert "| 1x8k | `m` | 20.0 | 1 | _w | waits | – | – |" in text
    assert "| 1x8k | `m` | 20.0 | _k | warps=2 | 19.0 |" in text


def test_stage_sweep_adds_rows_and_tiles_to_the_probabilities_launch():
    """``benchmarks/sketchwalk_authors/stage_sweep.py``: the settings it sweeps beyond warps and stages."""
    mod = load_bench("sketchwalk_authors/stage_sweep.py")

    def kernel(name):
        return type("K", (), {"__name__": name})()

    probs = mod.extra_settings(kernel("_row_probs_kernel"), (1, 8, 128), {"BLOCK_R": 32, "num_warps": 4})
    labels = {label for label, _, _ in probs}
    assert "BLOCK_R=32,warps=4" not in labels and {"BLOCK_R=16,warps=4", "BLOCK_R=128,warps=8"} <= labels
    assert all(grid == (1, 8, 128) for _, grid, _ in probs)
    logits = mod.extra_settings(kernel("_row_logits_kernel"), (1, 8, 128), {"BLOCK_R": 32, "num_warps": 4})
    assert [label for label, _, _ in logits] == ["BLOCK_R=16", "BLOCK_R=64"]
    assert mod.extra_settings(kernel("_walk_hop_kernel"), (1,), {"num_warps": 4}) == []
