"""Frozen outputs of every registered method: what the registry gave on fixed inputs, kept to show that
a refactoring of how methods are served changes no method's output or stats.

``python tests/frozen_registry.py OUT.pt`` records them with whatever kvsieve is on the path (the
committed file was recorded before the layer driver replaced the per-path serving code); the test
``test_frozen_registry.py`` recomputes them and compares.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvsieve  # noqa: E402
from kvsieve.core.registry import method_class  # noqa: E402
from kvsieve.core.rng import RandomKey  # noqa: E402

#: The stats fields compared (method-specific extras differ in kind across methods).
STAT_FIELDS = ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "kv_density", "bytes_read",
               "exact_rows")


#: Methods whose defaults changed on purpose after the recording (to their authors' rules): the settings
#: under which today's code restates the recorded rule.
RECORDED_RULE = {
    "magicpig": {"transform": "mips", "min_tables": 1, "weight_eps": 0.0},
    "sketchwalk": {"variant": "reconstruction", "density": 0.3},
}


def specs(saap_folder: str | None = None, recorded_rule: bool = False) -> dict[str, str]:
    """One spec per registered method: its declared ``small_config`` (with ``recorded_rule``, plus the
    settings that restate a changed default's old rule); SAAP's with test artifacts."""
    out = {}
    for name in kvsieve.methods():
        cls = method_class(name)
        if cls.contract_tested_in:
            if saap_folder is not None:
                out[name] = f"{name}:artifacts={saap_folder},probes=3"
            continue
        extra = RECORDED_RULE.get(name, {}) if recorded_rule else {}
        out[name] = kvsieve.method(name, **cls.small_config, **extra).spec
    return out


def inputs():
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(2, 4, 16, generator=g, dtype=torch.float64) * 1.5
    q3 = torch.randn(2, 4, 3, 16, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float64)
    return q, q3, k, v, torch.tensor([300, 251])


def decode_case(spec: str, layer_arg) -> dict:
    """Two calls (one row, three rows) with one state, fixed seeds; output and stats."""
    q, q3, k, v, lengths = inputs()
    m = kvsieve.method(spec)
    out = {}
    for tag, qq in (("row", q), ("chunk", q3)):
        est, stats = layer_arg(m, qq, k, v, lengths, RandomKey(5, (0, 3)))
        out[tag] = est.detach().clone()
        out[tag + "_stats"] = torch.tensor([float(stats[f]) for f in STAT_FIELDS], dtype=torch.float64)
    return out


def model_case(spec: str) -> dict:
    """Greedy tokens of a tiny random Llama (5 layers) under sparsify and under the decode runtime."""
    from tests.test_runtime import random_ids, tiny_model

    model = tiny_model("llama", num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2)
    ids = random_ids(1, 120, seed=77)
    with torch.no_grad(), kvsieve.sparsify(model, spec, phase="decode") as session:
        hf = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 120:]
    density = torch.tensor(session.mean("density"), dtype=torch.float64)
    rt = kvsieve.generate(model, ids, spec, max_new_tokens=6)
    return {"sparsify_tokens": hf, "sparsify_density": density, "runtime_tokens": rt.tokens}


def record(decode_with_layer, saap_folder: str | None) -> dict:
    results = {}
    for name, spec in specs(saap_folder).items():
        results[name] = {"spec": spec, **decode_case(spec, decode_with_layer)}
        if not method_class(name).contract_tested_in:
            results[name].update(model_case(spec))
    return results


if __name__ == "__main__":
    from tests.saap_helpers import write_artifacts

    def decode_before(m, q, k, v, lengths, key):  # the API before the layer driver: the layer in the state dict
        return m.decode(q, k, v, lengths=lengths, seed=key, state={"layer": 1})

    with tempfile.TemporaryDirectory() as folder:
        write_artifacts(Path(folder), heads=4, kv_heads=2, head_dim=16, clusters=8)
        torch.save(record(decode_before, folder), sys.argv[1])
