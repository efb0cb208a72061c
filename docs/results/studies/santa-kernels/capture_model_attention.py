"""Capture the default model's decode-step q/k/v (SmolLM2-135M, last token of a 2047-token essay
prompt, layers 1, 5, 10, 15, 20, 25, 29; bf16) for docs/results/studies/santa-kernels/model_attention_errors.py.

    python docs/results/studies/santa-kernels/capture_model_attention.py  # .device_data/smollm_attention.pt
"""
import time

import torch

import kvsieve
from kvsieve.assets import essay_texts
from kvsieve.integrations.hf import capture_attention

t0=time.time()
model, tok = kvsieve.load_model("default")
text = " ".join(essay_texts()[:3])
ids = tok(text, return_tensors="pt").input_ids[:, :2047]
print("tokens", ids.shape, time.time()-t0)
with torch.no_grad():
    out = model(ids[:, :-1], use_cache=True)
    cache = out.past_key_values
    with capture_attention(model, layers=[1, 5, 10, 15, 20, 25, 29]) as cap:
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
data = {}
for layer, q, k, v in cap.calls:
    data[layer] = (q[:, :, -1].to(torch.bfloat16).clone(), k.to(torch.bfloat16).clone(), v.to(torch.bfloat16).clone())
    print(layer, q.shape, k.shape)
torch.save(data, ".device_data/smollm_attention.pt")
print("done", time.time()-t0)
