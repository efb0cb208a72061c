"""SAAP's fit on models beyond the Llama family: Gemma 3's sliding-window and full-attention layers."""

import pytest
import torch
from saap_helpers import FIT, TEXTS, CharTokenizer

import kvsieve
from kvsieve.fit.saap import FitConfig, fit_saap
from kvsieve.methods.saap import model_rope


def test_fit_on_a_model_with_sliding_window_layers_fits_its_full_attention_layers(tmp_path):
    """Gemma 3: sliding-window layers run exact window attention, so the fit takes the full-attention layers
    (with their own RoPE frequencies), refuses a sliding one, and the artifacts serve the model: with every
    bucket probed the runtime's greedy tokens are dense's."""
    import transformers as tf

    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg = tf.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=24, layer_types=types, max_position_embeddings=1024,
                              attn_implementation="sdpa", eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    rope = model_rope(model)
    assert torch.equal(rope.inv_freq, model.model.rotary_emb.full_attention_inv_freq.float().cpu())
    fit = fit_saap(FitConfig(**FIT), tmp_path / "g", model_and_tokenizer=(model, CharTokenizer()), texts=TEXTS,
                   log=lambda s: None)
    assert fit["complete"] and fit["layers_done"] == [1, 3]
    with pytest.raises(ValueError, match=r"layers: \[2\] are sliding-window layers"):
        fit_saap(FitConfig(**{**FIT, "layers": (2, 3)}), tmp_path / "h", model_and_tokenizer=(model, CharTokenizer()),
                 texts=TEXTS, log=lambda s: None)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    spec = f"saap:artifacts={tmp_path / 'g'},probes=8"
    dense = kvsieve.generate(model, ids, max_new_tokens=4)
    got = kvsieve.generate(model, ids, spec, max_new_tokens=4)
    assert got.stats.window_layers == [0, 2] and list(got.stats.method_decode_layers) == [1, 3]
    assert torch.equal(got.tokens, dense.tokens)
