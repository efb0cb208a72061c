"""Every registered method gives what it gave before the layer driver served it: the outputs and stats of
``Method.decode`` on fixed inputs (one row and a chunk of three, one state), and the greedy tokens of a tiny
model under ``kvsieve.sparsify`` and under the decode runtime, equal the recorded ones
(``tests/data/frozen_registry.pt``, made by ``tests/frozen_registry.py`` before the change)."""

from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve import CallContext
from tests import frozen_registry as frozen
from tests.saap_helpers import write_artifacts

RECORDED = torch.load(Path(__file__).parent / "data" / "frozen_registry.pt", weights_only=False)


@pytest.fixture(scope="module")
def saap_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frozen_saap")
    write_artifacts(folder, heads=4, kv_heads=2, head_dim=16, clusters=8)
    return str(folder)


def decode_now(m, q, k, v, lengths, key):
    return m.decode(q, k, v, lengths=lengths, seed=key, state=m.new_state(), context=CallContext(layer=1))


def test_every_registered_method_was_recorded():
    assert set(RECORDED) == set(kvsieve.methods())


#: Methods whose chunk case changed on purpose since the recording, and why. Their row case stays checked.
CHANGED_CHUNK = {name: "SAAP's window slides since its index lives on the device: the chunk's rows, shorter than "
                       "the row the index was built at, see a full window (tests/test_saap_index.py checks it); "
                       "the row case reads the same keys (float64 rounding: a masked softmax, not two merged parts)"
                 for name in ("saap", "saap-kmeans", "saap-kmeans-roped")}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_outputs_and_stats_are_unchanged(name, saap_folder):
    spec = frozen.specs(saap_folder, recorded_rule=True)[name]
    want = RECORDED[name]
    if "artifacts=" not in spec and name not in frozen.RECORDED_RULE:
        assert spec == want["spec"]
    got = frozen.decode_case(spec, decode_now)
    # float64 to its rounding: the same computation differs in the last bits between CPUs (the BLAS kernels'
    # summation order: 4e-16 on some machines), and a restated rule computes the same formula in another order
    rtol = 1e-12 if name in frozen.RECORDED_RULE or name in CHANGED_CHUNK else 1e-14
    if name == "magicpig":  # its weights take arccos of cosines near ±1, which turns those last bits into ~1e-6
        rtol = 1e-5
    for tag in ("row",) if name in CHANGED_CHUNK else ("row", "chunk"):
        torch.testing.assert_close(got[tag], want[tag], rtol=rtol, atol=rtol, msg=f"{name} {tag}")
        torch.testing.assert_close(got[tag + "_stats"], want[tag + "_stats"], rtol=1e-12, atol=0,
                                   msg=f"{name} {tag} stats {frozen.STAT_FIELDS}")
    if "sparsify_tokens" in want:
        got = frozen.model_case(spec)
        assert got["sparsify_tokens"].tolist() == want["sparsify_tokens"].tolist()
        assert got["runtime_tokens"].tolist() == want["runtime_tokens"].tolist()
        torch.testing.assert_close(got["sparsify_density"], want["sparsify_density"], rtol=1e-12, atol=0)
