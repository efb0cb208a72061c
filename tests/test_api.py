"""The public method API: registry, spec strings, configs, StepStats, and every bad-input error."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_qkv

import kvsieve
from kvsieve.core.stats import StepStats

SANTA_FAMILY = ["santa", "santa-strat", "santa-sys", "santa-prop", "santa-flash"]


# --- registry and spec strings --------------------------------------------------------------


def test_methods_lists_the_builtin_methods_sorted():
    names = kvsieve.methods()
    assert names == sorted(names)
    assert {"dense", *SANTA_FAMILY} <= set(names)


def test_each_builtin_module_registers_the_names_the_methods_package_declares():
    import pkgutil
    import sys

    from kvsieve.core.registry import _REGISTRY

    builtin = sys.modules["kvsieve.methods"]  # the subpackage (the attribute kvsieve.methods is the function)
    modules = {info.name for info in pkgutil.iter_modules(builtin.__path__) if info.name != "shared"}
    assert modules == set(builtin.BUILTIN)
    builtin.load_all()
    by_module: dict[str, set[str]] = {}
    for name, cls in _REGISTRY.items():
        module = cls.__module__.removeprefix("kvsieve.methods.").split(".")[0]
        if cls.__module__.startswith("kvsieve.methods."):
            by_module.setdefault(module, set()).add(name)
    assert by_module == {module: set(names) for module, names in builtin.BUILTIN.items()}
    assert {name for names in builtin.BUILTIN.values() for name in names} <= set(kvsieve.methods())


def test_an_unknown_name_is_refused_without_importing_a_method_or_torch():
    import subprocess
    import sys

    code = ("import sys, kvsieve\n"
            "from kvsieve.core.registry import check_method_name\n"
            "try:\n    kvsieve.method('santa-sis:budget=3')\nexcept ValueError as e:\n    print(e)\n"
            "check_method_name('quest')\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvsieve.methods.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "unknown method 'santa-sis'. Did you mean 'santa-sys'" in out
    assert out.splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", ["dense", *SANTA_FAMILY])
def test_every_method_builds_with_defaults_and_has_a_summary(name):
    m = kvsieve.method(name)
    assert isinstance(m, kvsieve.Method)
    assert m.name == name and m.summary
    assert m.spec == name  # defaults leave nothing to write after the name
    assert m.stochastic == (name != "dense")


@pytest.mark.parametrize(
    ("spec", "kwargs"),
    [
        ("santa-sys:budget=128", {"budget": 128}),
        ("santa:budget=7,exact_when_covered=false", {"budget": 7, "exact_when_covered": False}),
        ("santa-prop:budget=32,tile_size=16,rounding=systematic",
         {"budget": 32, "tile_size": 16, "rounding": "systematic"}),
        ("santa-flash:tile_size=64", {"tile_size": 64}),
        (" santa-strat : budget = 9 ", {"budget": 9}),
    ],
)
def test_keywords_and_spec_string_build_the_same_method(spec, kwargs):
    name = spec.split(":")[0].strip()
    from_spec = kvsieve.method(spec)
    from_kwargs = kvsieve.method(name, **kwargs)
    assert type(from_spec) is type(from_kwargs)
    assert from_spec.config == from_kwargs.config
    for key, value in kwargs.items():
        assert getattr(from_spec.config, key) == value
    # The spec string is a faithful round trip.
    rebuilt = kvsieve.method(from_kwargs.spec)
    assert rebuilt.config == from_kwargs.config
    assert repr(from_kwargs) == f"kvsieve.method({from_kwargs.spec!r})"


def test_spec_string_and_keywords_combine():
    m = kvsieve.method("santa-prop:budget=32", rounding="systematic")
    assert (m.config.budget, m.config.rounding) == (32, "systematic")


def test_method_instance_passes_through():
    m = kvsieve.method("santa-sys", budget=8)
    assert kvsieve.method(m) is m
    with pytest.raises(ValueError, match="keyword"):
        kvsieve.method(m, budget=4)


def test_parse_spec():
    assert kvsieve.parse_spec("santa-sys") == ("santa-sys", {})
    assert kvsieve.parse_spec("santa-prop:budget=1,rounding=systematic") == (
        "santa-prop", {"budget": "1", "rounding": "systematic"})


@pytest.mark.parametrize(
    ("wrong", "expected"),
    [("santa-sy", "santa-sys"), ("santa-strta", "santa-strat"), ("dens", "dense"),
     ("SANTA-SYS", "santa-sys"), ("Dense", "dense")],
)
def test_unknown_method_suggests_close_matches(wrong, expected):
    with pytest.raises(ValueError, match=r"unknown method") as info:
        kvsieve.method(wrong)
    assert f"Did you mean '{expected}'" in str(info.value)


def test_unknown_method_without_close_match_lists_the_registry():
    with pytest.raises(ValueError, match="unknown method 'zzzz'") as info:
        kvsieve.method("zzzz")
    assert "Did you mean" not in str(info.value)
    assert "santa-sys" in str(info.value)


@pytest.mark.parametrize(
    "spec",
    ["", "   ", "santa:", "santa:budget", "santa:budget=", "santa:=4", "santa:budget=4,",
     "santa:budget=4,,exact_when_covered=true", "santa:budget=4,budget=5"],
)
def test_malformed_spec_strings(spec):
    with pytest.raises(ValueError, match="spec|method"):
        kvsieve.method(spec)


@pytest.mark.parametrize("spec", [None, 3, ["santa"]])
def test_spec_of_the_wrong_type(spec):
    with pytest.raises(ValueError, match="method"):
        kvsieve.method(spec)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: kvsieve.method("santa:budjet=3"), "Did you mean budget"),
        (lambda: kvsieve.method("santa", budjet=3), "Did you mean budget"),
        (lambda: kvsieve.method("santa-sys", tile_size=16), "no parameter 'tile_size'"),
        (lambda: kvsieve.method("dense", budget=16), "no parameter 'budget'"),
        (lambda: kvsieve.method("santa:budget=4", budget=4), "both in the spec string and as keywords"),
    ],
)
def test_unknown_parameters_are_named(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


@pytest.mark.parametrize(
    ("spec", "kwargs", "argument"),
    [
        ("santa:budget=abc", {}, "budget"),
        ("santa:budget=1.5", {}, "budget"),
        ("santa", {"budget": 1.5}, "budget"),
        ("santa", {"budget": "8"}, "budget"),
        ("santa", {"budget": True}, "budget"),
        ("santa:exact_when_covered=maybe", {}, "exact_when_covered"),
        ("santa", {"exact_when_covered": "no"}, "exact_when_covered"),
        ("santa-prop", {"exact_when_covered": 0}, "exact_when_covered"),
        ("santa-prop:rounding=nearest", {}, "rounding"),
        ("santa-prop", {"rounding": "floor"}, "rounding"),
        ("santa-flash:tile_size=-1", {}, "tile_size"),
        ("santa-flash", {"tile_size": 2.0}, "tile_size"),
    ],
)
def test_ill_typed_parameters_are_named(spec, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        kvsieve.method(spec, **kwargs)


@pytest.mark.parametrize("name", SANTA_FAMILY)
@pytest.mark.parametrize("budget", [0, -3])
def test_budget_below_one(name, budget):
    # The config validates without knowing the method; the registry names it.
    with pytest.raises(ValueError, match=rf"^{name}: budget: expected an integer >= 1"):
        kvsieve.method(name, budget=budget)
    with pytest.raises(ValueError, match=rf"^{name}: budget"):
        kvsieve.method(f"{name}:budget={budget}")


@pytest.mark.parametrize("name", ["dense", *SANTA_FAMILY])
def test_parameters_are_documented(name):
    cls = type(kvsieve.method(name))
    for field_name, type_text, _default, help_text in cls.config_class.parameters():
        assert field_name and type_text and help_text


# --- StepStats --------------------------------------------------------------------------------


def test_step_stats_mapping_and_attribute_access():
    q, k, v = random_qkv(batch=2, heads=4, kv_heads=2, n=50, d=8)
    _, stats = kvsieve.method("santa-sys", budget=8).decode(q, k, v, seed=0)
    assert isinstance(stats, StepStats)
    for key in ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "kv_density",
                "bytes_read", "backend", "exact_rows", "samples"):
        assert key in stats
        assert stats[key] == getattr(stats, key)
    assert stats.backend == "reference"
    assert stats["samples"] == 8  # method-specific values live in extra, reachable both ways
    assert "extra" not in list(stats)
    assert len(stats) == len(list(stats))
    flat = stats.as_dict()
    assert set(flat) == set(stats) and flat["density"] == stats.density
    with pytest.raises(KeyError):
        stats["nope"]
    with pytest.raises(AttributeError):
        _ = stats.nope
    assert stats.get("nope", 5) == 5


# --- bad decode inputs ------------------------------------------------------------------------


def _inputs(**kw):
    return random_qkv(batch=2, heads=4, kv_heads=2, n=20, d=8, **kw)


def _decode(method="santa-sys", **kw):
    m = kvsieve.method(method) if method == "dense" else kvsieve.method(method, budget=4)
    return m.decode(**kw)


@pytest.mark.parametrize("method", ["dense", *SANTA_FAMILY])
@pytest.mark.parametrize(
    ("mutate", "argument"),
    [
        (lambda q, k, v: (q[0], k, v), r"q: expected shape \[B, Hq, d\]"),
        (lambda q, k, v: (q, k[0], v), r"k: expected shape \[B, Hkv, N, d\]"),
        (lambda q, k, v: (q, k, v[..., 0]), r"v: expected shape \[B, Hkv, N, dv\]"),
        (lambda q, k, v: (q[:1], k, v), r"k, v: batch"),
        (lambda q, k, v: (q, k, v[:1]), r"k, v: batch"),
        (lambda q, k, v: (q[..., :6], k, v), r"k: head dim"),
        (lambda q, k, v: (q, k, v[:, :, :10]), r"v: shape .* does not match k"),
        (lambda q, k, v: (q, k, v[:, :1]), r"v: shape .* does not match k"),
        (lambda q, k, v: (q[:, :3], k, v), r"q: 3 query heads is not a multiple of k's 2 KV heads"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), r"k: the cache holds no keys"),
        (lambda q, k, v: (q[:0], k[:0], v[:0]), r"empty batch"),
        (lambda q, k, v: (q.float(), k, v), r"q, k, v: expected one dtype"),
        (lambda q, k, v: (q, k, v.half()), r"q, k, v: expected one dtype"),
        (lambda q, k, v: (q.int(), k, v), r"q: expected dtype"),
        (lambda q, k, v: (q, k.numpy(), v), r"k: expected a torch.Tensor"),
        (lambda q, k, v: (q, k.to("meta"), v), r"q, k, v: expected one device"),
    ],
)
def test_bad_shapes_dtypes_devices(method, mutate, argument):
    q, k, v = mutate(*_inputs())
    with pytest.raises(ValueError, match=argument):
        _decode(method, q=q, k=k, v=v, seed=0)


@pytest.mark.parametrize("method", ["dense", *SANTA_FAMILY])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_named(method, which, bad):
    tensors = dict(zip("qkv", _inputs(), strict=True))
    t = tensors[which].clone()
    t.view(-1)[3] = bad
    tensors[which] = t
    with pytest.raises(ValueError, match=rf"{which}: contains NaN or infinite values"):
        _decode(method, **tensors, seed=0)


def test_non_finite_check_can_be_skipped_explicitly():
    q, k, v = _inputs()
    v = v.clone()
    v[0, 0, 3, 0] = math.nan
    out, _ = kvsieve.method("dense").decode(q, k, v, check_finite=False)
    assert torch.isnan(out[0, :2]).any()  # the caller asked for it; row 1 is untouched
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("method", ["dense", *SANTA_FAMILY])
@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        (torch.tensor([0, 5]), r"lengths: expected values in \[1, 20\]"),
        (torch.tensor([21, 5]), r"lengths: expected values in \[1, 20\]"),
        (torch.tensor([-1, 5]), r"lengths: expected values in \[1, 20\]"),
        (torch.tensor([5]), r"lengths: expected shape \[2\]"),
        (torch.tensor([[5, 5]]), r"lengths: expected shape \[2\]"),
        (torch.tensor([5.0, 5.0]), r"lengths: expected an integer tensor"),
        (torch.tensor([True, True]), r"lengths: expected an integer tensor"),
        ([5, 30], r"lengths: expected values in \[1, 20\]"),
    ],
)
def test_lengths_out_of_range(method, lengths, message):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=message):
        _decode(method, q=q, k=k, v=v, lengths=lengths, seed=0)


def test_lengths_as_list_is_accepted():
    q, k, v = _inputs()
    a, _ = kvsieve.method("dense").decode(q, k, v, lengths=[5, 20])
    b, _ = kvsieve.method("dense").decode(q, k, v, lengths=torch.tensor([5, 20]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["dense", *SANTA_FAMILY])
@pytest.mark.parametrize(
    ("make_mask", "message"),
    [
        (lambda: torch.ones(2, 20, dtype=torch.long), r"key_mask: expected a bool tensor"),
        (lambda: [[True] * 20] * 2, r"key_mask: expected a bool tensor"),
        (lambda: torch.ones(2, 19, dtype=torch.bool), r"key_mask: expected shape \[2, 20\]"),
        (lambda: torch.ones(1, 20, dtype=torch.bool), r"key_mask: expected shape \[2, 20\]"),
        (lambda: torch.ones(20, dtype=torch.bool), r"key_mask: expected shape \[2, 20\]"),
        (lambda: torch.stack([torch.ones(20, dtype=torch.bool), torch.zeros(20, dtype=torch.bool)]),
         r"key_mask: every batch row needs at least one valid key"),
    ],
)
def test_key_mask_wrong(method, make_mask, message):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=message):
        _decode(method, q=q, k=k, v=v, key_mask=make_mask(), seed=0)


def test_lengths_and_key_mask_together():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="lengths, key_mask: give at most one"):
        _decode(q=q, k=k, v=v, lengths=torch.tensor([3, 3]), key_mask=torch.ones(2, 20, dtype=torch.bool))


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, "0.1", True])
def test_bad_scale(scale):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="scale: expected a positive"):
        _decode(q=q, k=k, v=v, scale=scale, seed=0)


@pytest.mark.parametrize("seed", [1.5, "7", True, [1]])
def test_bad_seed(seed):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="seed: expected an int, a torch.Generator or None"):
        _decode(q=q, k=k, v=v, seed=seed)
