"""SAAP fits for the benchmarks' random-weight model shapes.

A method that needs fitted artifacts (``needs_fit``: SAAP and its k-means baselines) given to ``kvsieve bench
e2e`` without ``artifacts=`` gets a fit of the bench's own random-weight model of the shape: ``kvsieve fit
saap`` (:func:`kvsieve.fit.saap.fit_saap`) on prompts of random token ids drawn as the bench draws its own
prompts (:func:`kvsieve.bench.peaked.bench_prompts`: the whole vocabulary, or a peaked model's first token then
ids of its prompt vocabulary), with :data:`BENCH_FIT`'s reduced settings (few training steps: the fit sets which
keys a step reads and the probe's cost, which the speed tables measure). The keys the fit clusters must come from
the tokens the bench serves: a peaked model's keys are its tokens' codes, and centroids fitted on other tokens'
codes cut the served ones into uneven buckets, so a step reads several times the ℓ/C share of the keys. The fit
lands in ``<cache>/<shape>-<config hash>-<weights fingerprint>-<settings hash>-<token source>`` and is reused
while the model and the settings are the same; the results record the settings and the time the fit took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.registry import method_class, parse_spec
from ..fit.saap import FitConfig, fit_saap
from ..methods.saap import MANIFEST, config_hash, weights_fingerprint

#: The bench's fit: the paper's C = 1024 buckets, a classifier of hidden width 256 (the paper's is 1024: a
#: quarter of the weights a decode step reads, at the recall the 1024-wide one has on SmolLM2's fit,
#: docs/methods/saap.md "Classifier width"), from four 4096-token prompts of random ids (16 keys a bucket: one
#: prompt left buckets of 4 keys, fitted to single keys), spherical k-means of the paper's 10 rounds in torch on
#: the model's device (FAISS's CPU path takes about 0.35 s a call, 16 calls a layer), 64 candidate queries per
#: head and prompt, 20 Adam steps.
BENCH_FIT = dict(clusters=1024, kmeans_iters=10, kmeans_backend="torch", prompt_tokens=4096, prompts=4,
                 val_prompts=0, queries=64, hidden=256, steps=20, batch=256, seed=0)
DEFAULT_CACHE = "~/.cache/kvsieve/saap-bench-fits"


class RandomTokens:
    """A tokenizer stand-in for a random-weight model: every call gives the same seeded random ids, as
    many as the text has characters (the fit cuts its prompts from them). With ``peaked`` (a peaked model's
    :class:`kvsieve.bench.peaked.PeakedAttention`) each ``prompt_tokens`` of them are one prompt as the bench
    draws it (its first token, then ids of the prompt vocabulary); else ids over the whole ``vocab``."""

    def __init__(self, vocab: int, seed: int = 0, *, peaked=None, prompt_tokens: int = 0) -> None:
        if peaked is not None and (isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int)
                                   or prompt_tokens < 1):
            raise ValueError(f"prompt_tokens: expected a positive integer with peaked, got {prompt_tokens!r}")
        self.vocab, self.seed, self.peaked, self.prompt_tokens = vocab, seed, peaked, prompt_tokens

    @property
    def source(self) -> str:
        """What the ids are drawn from, for the fit's record and its cache folder."""
        return "all-ids" if self.peaked is None else f"peaked-vocab{self.peaked.vocab}"

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        from .peaked import prompt_tokens

        g = torch.Generator().manual_seed(self.seed)
        if self.peaked is None:
            return {"input_ids": torch.randint(0, self.vocab, (len(text),), generator=g).tolist()}
        if len(text) % self.prompt_tokens:
            raise ValueError(f"text: {len(text)} characters are not whole prompts of {self.prompt_tokens}")
        return {"input_ids": prompt_tokens(self.peaked, self.prompt_tokens, len(text) // self.prompt_tokens,
                                           g).flatten().tolist()}


def needs_bench_fit(spec: str) -> bool:
    """Whether ``spec`` names a method that needs fitted artifacts and gives none."""
    name, values = parse_spec(spec)
    return method_class(name).needs_fit and "artifacts" not in values


def check_spec(spec: str) -> None:
    """ValueError for a bad spec; one that will get a bench fit has its config checked (no folder yet)."""
    if needs_bench_fit(spec):
        name, values = parse_spec(spec)
        method_class(name).config_class.from_strings(name, values)  # every field but the artifacts
        return
    from ..core.registry import method

    method(spec)


def bench_fit(model: torch.nn.Module, shape: str, cache: str | Path = DEFAULT_CACHE,
              log: Callable[[str], None] = print, **overrides: Any) -> dict[str, Any]:
    """The folder of a SAAP fit of ``model`` (the bench's random-weight ``shape``), made there unless it
    holds one; returns ``{"artifacts", "settings", "fit_s" (None when loaded), "cached"}``."""
    settings = {**BENCH_FIT, **overrides}
    cfg = FitConfig(model=f"random-weights {shape}", **settings)
    vocab = model.get_input_embeddings().weight.shape[0]
    tokens = RandomTokens(vocab, peaked=getattr(model, "peaked_attention", None), prompt_tokens=cfg.prompt_tokens)
    folder = Path(cache).expanduser() / f"{shape}-{config_hash(model.config)}-{weights_fingerprint(model)}-" \
                                        f"{cfg.fingerprint()}-{tokens.source}"
    info = {"artifacts": str(folder), "settings": settings,
            "command": f"kvsieve.fit.saap.fit_saap on random ids ({tokens.source}: as the bench's prompts)"}
    manifest = folder / MANIFEST
    if manifest.is_file():
        import json

        if json.loads(manifest.read_text()).get("complete"):
            log(f"{shape}: SAAP fit loaded from {folder}")
            return {**info, "fit_s": None, "cached": True}
    texts = ["x" * (cfg.prompt_tokens * (cfg.prompts + cfg.val_prompts))]
    t0 = time.perf_counter()
    fit_saap(cfg, folder, overwrite=True, log=log, model_and_tokenizer=(model, tokens), texts=texts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    fit_s = time.perf_counter() - t0
    log(f"{shape}: SAAP fit made in {fit_s:.1f} s ({folder})")
    return {**info, "fit_s": round(fit_s, 2), "cached": False}


def resolve_methods(methods: Sequence[str], model: torch.nn.Module, shape: str, cache: str | Path | None,
                    log: Callable[[str], None] = print) -> tuple[dict[str, str], dict[str, Any] | None]:
    """``(spec per variant label, fit info or None)``: methods that need a fit and give no artifacts get
    the bench fit's folder (one fit per model, shared by them)."""
    specs, fit = {}, None
    for spec in methods:
        if needs_bench_fit(spec):
            if fit is None:
                fit = bench_fit(model, shape, DEFAULT_CACHE if cache is None else cache, log)
            name, values = parse_spec(spec)
            specs[spec] = f"{name}:" + ",".join([f"artifacts={fit['artifacts']}"]
                                                 + [f"{k}={v}" for k, v in values.items()])
        else:
            specs[spec] = spec
    return specs, fit


def fitted_specs(methods, model, shape: str, cache: str | None, results: dict, log) -> dict[str, str]:
    """Each method's spec, with the bench fit's artifacts where it needs a fit and names none."""
    if not any(needs_bench_fit(m) for m in methods):
        return {}
    try:
        specs, fit = resolve_methods(methods, model, shape, cache, log)
    except Exception as exc:  # noqa: BLE001 - the fit failing fails its variants only (their rows say why)
        results.setdefault("saap_fits", {})[shape] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return {}
    results.setdefault("saap_fits", {})[shape] = fit
    return specs


def fit_line(fit: dict) -> str:
    """One line for a report's header: how the shape's bench fit was made (or why it failed)."""
    if "error" in fit:
        return f"failed ({fit['error']})"
    made = "loaded from the cache" if fit["cached"] else f"made in {fit['fit_s']:.1f} s"
    settings = ", ".join(f"{k}={v}" for k, v in fit["settings"].items())
    return f"{fit['command']}, {made}; {settings}"
