"""Bernoulli qKᵀ (the SANTA paper's Sec. 5 and Appendix C): torch references on plain tensors.

A query ``q`` is divided by ``norm ≥ max_i |q_i|`` so that ``f_i = |q_i| / norm`` is a probability.
Each of B draws keeps feature i with probability ``f_i`` and gives the ternary query
``q̂ⁿ_i = bⁿ_i · sign(q_i) ∈ {-1, 0, +1}``; ``p̂ = (norm / B) Σ_n q̂ⁿ Kᵀ`` (Eq. 5/9) is unbiased for
``qKᵀ`` and reads only the K features some draw kept. Since ``Σ_n q̂ⁿ = sign(q) · c`` with
``c_i`` the number of draws that kept feature i, the estimate is ``q_est Kᵀ`` with the *effective
query* ``q_est = (norm / B) · sign(q) · c``; every function here returns that effective query
(zero on the features no draw kept) and the mask of features read.

Draws of feature i (``u`` uniform in [0, 1)):

- ``iid``: ``bⁿ_i = 1{uⁿ_i < f_i}``, so ``c_i ~ Binomial(B, f_i)``; per-feature variance of
  ``c_i / B`` is ``f(1−f)/B``.
- ``stratified`` (the paper's Tables 5–7; the paper does not define it, this is the spec's
  reading): ``bⁿ_i = 1{(n + uⁿ_i)/B < f_i}``, one draw per stratum ``[n/B, (n+1)/B)``. Then
  ``c_i = floor(B f_i) + Bernoulli(frac(B f_i))`` and the variance of ``c_i / B`` is
  ``r(1−r)/B²`` with ``r = frac(B f_i)``: the ``O(1/B²)`` the paper states.
  ``strata="per-feature"`` (default) draws ``uⁿ_i`` independently for every feature, so features
  stay independent as Eq. 8 says; ``strata="shared"`` uses one ``uⁿ`` per draw for all features of
  a query (B random numbers per query, the cheap hardware reading): the same marginals, but
  features in the same stratum are positively correlated.

Mean-group query (App. C.2, Eq. 10–13): one feature set per GQA group from
``m = mean_g |q_g|``: ``m̂ = (norm / B) c`` with ``c`` drawn from ``f = m / norm``, and head g uses
``q_est_g = m̂ ⊙ q_g / m`` (``q_g / m := 0`` where ``m = 0``). Unbiased since ``E[m̂] = m``.
"""

from __future__ import annotations

from typing import TypedDict, Unpack

import torch

SAMPLINGS = ("stratified", "iid")
STRATA = ("per-feature", "shared")


def check_draws(draws: object) -> int:
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws: expected an integer >= 1 (the Bernoulli sample count B), got {draws!r}")
    return draws


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or infinite values")


def inclusion_probabilities(
    magnitude: torch.Tensor,
    norm: torch.Tensor | float | None = None,
    *,
    norm_factor: float = 1.0,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``f = magnitude / norm`` (float64) and ``norm [..., 1]`` for ``magnitude [..., d] ≥ 0``.

    ``norm=None`` takes ``norm_factor · max_i magnitude_i`` per row (``norm_factor ≥ 1``). A given
    ``norm`` (a number or a tensor broadcastable to ``[..., 1]``) must be positive and at least the
    row's maximum, else f would not be a probability. A row of zeros gets ``f = 0`` (its estimate is
    the exact 0). ``check_values`` reads the data (non-finite entries, a given norm's range).
    """
    if isinstance(norm_factor, bool) or not isinstance(norm_factor, (int, float)) or not norm_factor >= 1.0 \
            or norm_factor == float("inf"):
        raise ValueError(f"norm_factor: expected a finite number >= 1 (norm >= max|q|), got {norm_factor!r}")
    mag = magnitude.to(torch.float64)
    if check_values:
        _check_finite("q", mag)
    row_max = mag.amax(-1, keepdim=True)
    if norm is None:
        norm_t = row_max * float(norm_factor)
    else:
        norm_t = torch.as_tensor(norm, dtype=torch.float64, device=mag.device)
        if check_values:
            if not bool((norm_t > 0).all()) or not bool(torch.isfinite(norm_t).all()):
                raise ValueError(f"norm: expected positive finite values, got min {float(norm_t.min())}")
            if not bool((norm_t >= row_max).all()):
                raise ValueError("norm: expected norm >= max_i |q_i| in every row "
                                 "(else |q_i|/norm is not a probability)")
        norm_t = norm_t.expand_as(row_max)
    safe = torch.where(norm_t > 0, norm_t, torch.ones_like(norm_t))
    f = torch.where(norm_t > 0, mag / safe, torch.zeros_like(mag))
    return f, norm_t


def bernoulli_draws(
    f: torch.Tensor,
    draws: int,
    *,
    sampling: str = "stratified",
    strata: str = "per-feature",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """The draws ``b [..., B, d]`` (bool) for inclusion probabilities ``f [..., d]`` in [0, 1].

    ``uniforms`` (float64 in [0, 1), shape ``[..., B, d]``, or ``[..., B, 1]`` for shared strata)
    replaces the generator: the counter-based numbers of ``core.rng`` that the kernel path draws too.
    A stratified draw reads only the uniform of stratum ``floor(B f_i)``: the others decide nothing."""
    check_draws(draws)
    _check_choice("sampling", sampling, SAMPLINGS)
    _check_choice("strata", strata, STRATA)
    if sampling == "iid" and strata != "per-feature":
        raise ValueError("strata: 'shared' couples the strata of stratified draws; i.i.d. draws take 'per-feature'")
    shape = (*f.shape[:-1], draws, f.shape[-1] if strata == "per-feature" else 1)
    if uniforms is None:
        u = torch.rand(shape, generator=generator, device=f.device, dtype=torch.float64)
    elif tuple(uniforms.shape) != shape:
        raise ValueError(f"uniforms: expected shape {list(shape)} (the draws' [..., B, d or 1]), got "
                         f"{list(uniforms.shape)}")
    else:
        u = uniforms.to(torch.float64)
    f = f.to(torch.float64).unsqueeze(-2)
    if sampling == "iid":
        return u < f
    n = torch.arange(draws, device=f.device, dtype=torch.float64)[:, None]
    # Stratum n holds [n/B, (n+1)/B); compare in units of 1/B so that B·f integer is exact.
    return (n + u) < f * draws


def bernoulli_counts(f: torch.Tensor, draws: int, **kwargs) -> torch.Tensor:
    """``c [..., d]`` (int64): how many of the B draws kept each feature."""
    return bernoulli_draws(f, draws, **kwargs).sum(-2)


class DrawOptions(TypedDict, total=False):
    """The keyword options shared by :func:`ternary_queries`, :func:`bernoulli_query` and
    :func:`mean_group_query` (defaults in :func:`_kept_features`)."""

    norm: torch.Tensor | float | None  # the normaliser (default max |q| over the feature axis)
    norm_factor: float
    sampling: str  # "stratified" or "iid"
    strata: str  # "per-feature" or "shared"
    generator: torch.Generator | None
    uniforms: torch.Tensor | None  # counter-based uniforms [..., B, d] instead of the generator
    check_values: bool


def _kept_features(absq: torch.Tensor, draws: int, *, norm: torch.Tensor | float | None = None,
                   norm_factor: float = 1.0, sampling: str = "stratified", strata: str = "per-feature",
                   generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None,
                   check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b [..., B, d] bool, norm [..., 1])``: the B draws' kept features of the magnitudes ``absq``."""
    f, norm_t = inclusion_probabilities(absq, norm, norm_factor=norm_factor, check_values=check_values)
    return bernoulli_draws(f, draws, sampling=sampling, strata=strata, generator=generator,
                           uniforms=uniforms), norm_t


def ternary_queries(q: torch.Tensor, draws: int, **options: Unpack[DrawOptions]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ternary queries ``q̂ [..., B, d]`` (int8 in {-1, 0, +1}) of Eq. 8 and ``norm [..., 1]``."""
    b, norm_t = _kept_features(q.abs(), draws, **options)
    return (b.to(torch.int8) * torch.sign(q).to(torch.int8).unsqueeze(-2)), norm_t


def bernoulli_query(q: torch.Tensor, draws: int, **options: Unpack[DrawOptions]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query Bernoulli qKᵀ: the effective query ``q_est [..., d]`` (float64) and ``read [..., d]``.

    ``q_est = (norm / B) Σ_n q̂ⁿ``, so ``q_est · k`` is Eq. 5 for any key k; ``read`` marks the
    features some draw kept (the K features this query reads).
    """
    b, norm_t = _kept_features(q.abs(), draws, **options)
    c = b.sum(-2)
    q_est = (norm_t / draws) * torch.sign(q.to(torch.float64)) * c.to(torch.float64)
    return q_est, c > 0


def mean_group_query(q: torch.Tensor, draws: int, **options: Unpack[DrawOptions]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-group query (Eq. 10–13) for ``q [..., G, d]`` (the group on axis -2).

    Returns ``q_est [..., G, d]`` (float64) with ``q_est_g = m̂ ⊙ q_g / m`` and ``read [..., d]``,
    the features of the group's one shared set (``m̂ ≠ 0``). ``norm`` is per group, ``[..., 1]``.
    """
    if q.dim() < 2:
        raise ValueError(f"q: expected shape [..., G, d] (the group on axis -2), got {tuple(q.shape)}")
    q64 = q.to(torch.float64)
    if options.get("check_values", True):
        _check_finite("q", q64)
    m = q64.abs().mean(-2)
    b, norm_t = _kept_features(m, draws, **{**options, "check_values": False})
    c = b.sum(-2)
    m_hat = (norm_t / draws) * c.to(torch.float64)
    ratio = torch.where(m[..., None, :] > 0, q64 / torch.where(m > 0, m, torch.ones_like(m))[..., None, :],
                        torch.zeros_like(q64))
    return m_hat[..., None, :] * ratio, c > 0


def estimated_scores(
    q_est: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled scores ``scale · q_est Kᵀ`` ``[B, Hq, N]`` (float64), -inf where ``key_mask [B, N]`` is False.

    ``q_est [B, Hq, d]``; ``k [B, Hkv, N, d]`` with query head h on KV head ``h // (Hq / Hkv)``.
    """
    b, hq, d = q_est.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q_est.to(torch.float64).view(b, hkv, hq // hkv, d)
    s = torch.matmul(qg, k.to(torch.float64).transpose(-1, -2)).view(b, hq, n) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, :], float("-inf"))
    return s


def ternary_scores_gather_add(q_hat: torch.Tensor, k: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """Eq. 5 as the paper computes it, without multiplies by q: for one query ``q_hat [B, d]``
    (int8 ternary draws) and keys ``k [N, d]``, ``(norm / B) Σ_n (Σ_{q̂ⁿ_i=+1} K_:,i − Σ_{q̂ⁿ_i=-1} K_:,i)``.

    Only the K columns some draw kept are gathered. A check of the effective-query form, not a fast
    path.
    """
    kd = k.to(torch.float64)
    total = torch.zeros(k.shape[0], dtype=torch.float64, device=k.device)
    for draw in q_hat:
        plus = torch.nonzero(draw > 0).flatten()
        minus = torch.nonzero(draw < 0).flatten()
        total = total + kd.index_select(1, plus).sum(1) - kd.index_select(1, minus).sum(1)
    return total * (norm.to(torch.float64).reshape(()) / q_hat.shape[0])
