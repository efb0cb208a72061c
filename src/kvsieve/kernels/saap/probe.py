"""SAAP's probe on the device: de-rope the step's queries, run the bucket classifier, sum the group's
probabilities, take the top-ℓ — three Triton launches where the torch path takes about twenty small ops.

Contract
--------
- ``q [B, Hq, d]`` post-RoPE queries, ``positions [B]`` the position each row's query sits at, RoPE
  as :class:`kvsieve.methods.saap.Rope` (``inv_freq [d/2]``, ``scaling`` its ``attention_scaling``);
- the classifier of one layer with its BatchNorm folded into the first linear map (eval mode:
  :func:`fold_batchnorm`): ``w1 [M, d, H]``, ``b1 [M, H]``, ``w2 [M, H, C]``, ``b2 [M, C]``, one model
  per KV head (``M = Hkv``) or per query head (``M = Hq``); model ``m`` serves query heads
  ``m·(Hq/M) ...``;
- returns ``scores [B, Hkv, C]``: ``Σ_{g in group} softmax(f(derope(q_g)))``, the batched probing of
  the paper (App. E.3), whose top-ℓ the method visits.

:func:`probe_scores_reference` is the same computation in torch (float32).

Kernels. The hidden layer (one program per (model, hidden block, row block), the result through memory), the
logits (one program per (model, bucket block, slice of the hidden units)), then the rank: the softmax needs a whole
row of logits, so one program per (batch row, KV head, chunk of buckets) computes the softmaxes, their group sum and
the ranks of the chunk's buckets (the top-ℓ); or (:data:`RANK_FORM` ``"scores"``) one launch computes each (row, KV
head)'s group scores once and the chunks' programs of a fourth rank them, reading them back. Dots run in IEEE
float32: TF32 rounding moved near-tied buckets in and out of the top-ℓ. The hidden layer is tiled over rows as well
as units (:data:`HIDDEN_TILE_H`, :data:`HIDDEN_TILE_R`), so a program's products stay the same size whatever the
batch.

SAAP's index update (``tail``) rides in these launches, work the probe does not depend on, so a decode step
costs no launch of its own for it. Which update runs is a host rule on the batch
(:func:`kvsieve.kernels.saap.index.parallel_update`): at batch 1 the parallel update's two stages
(:func:`~kvsieve.kernels.saap.index.assign_partial_program` as extra programs of the hidden-layer launch,
:func:`~kvsieve.kernels.saap.index.assign_reduce_program` of the rank launch); at larger batches the serial update
(:func:`~kvsieve.kernels.saap.index.assign_tail_program`) as extra programs of the hidden-layer launch, which then
lasts as long as its C / 128 dependent centroid reads (24 µs a layer measured end to end at 128k, H200).

Weights at serve time (:func:`serve_weights`): ``W1'`` and ``W2`` in bfloat16, biases in float32. ``W2``
(``M·H·C``, 8 × 1024 × 1024 at Llama-3.1-8B shapes) is the largest read of a decode step at 32k keys:
33.5 MB in float32, 16.8 MB in bfloat16. Activations stay float32: the kernels upcast the weights
(hidden layer) or split the float32 hidden activations into three bfloat16 terms whose sum is the
float32 value to 2^-24 (logits), so that the bfloat16 tensor cores multiply them by the exact bfloat16
weights with float32 accumulation: the product is float32 arithmetic on the rounded weights, which
is what the references compute (they take the same rounded tensors).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from .index import assign_partial_program, assign_reduce_program, assign_tail_program
except ImportError:  # pragma: no cover - CPU installs without triton run the reference
    triton = None

# The group softmax + top-l runs as Hkv·B·C/RANK_CHUNK programs (256 at Llama-3.1-8B shapes, C = 1024):
# each recomputes the C group-summed scores from the logits in L2 and ranks its RANK_CHUNK buckets against
# them (RANK_CHUNK × C comparisons), where one program per (row, KV head) would be latency-bound whatever
# its pass count (docs/results/gpu-bench/2026-11-27-h200-saap-decode-r4-main.md). Module constants so a sweep
# can set them.
RANK_CHUNK = 32
RANK_WARPS = 4
# Buckets ranked per pass of a program (a [RANK_SUB, C] comparison tile): a RANK_CHUNK above it takes several
# passes over one softmax. At batch 8 the rank launch is 2048 programs (34 µs against 8.8 at batch 1, H200): each
# recomputes the group's C scores from G·parts logit rows (64 KB of L2 reads at Llama-3.1-8B shapes), so the
# launch's reads and exponentials grow with B·C/RANK_CHUNK; a larger chunk at larger batches cuts them (the
# probe bench's --sweep rank times it).
RANK_SUB = 32
# Where the group scores come from (probe_scores_triton's ``rank_form``, default this constant): "chunks", every rank
# program recomputes its (row, KV head)'s C scores from the logits; "scores", one launch of its own computes them once
# per (row, KV head) (B·Hkv programs) and the rank programs read those 4 KB instead of the G·parts logit rows (64 KB),
# one launch more; "auto", "scores" from RANK_SCORES_FROM (row, KV head) pairs on (a host rule on the shapes:
# capturable), "chunks" below. The two forms give the same top-ℓ; their scores are equal to the bit under the
# interpreter and to float32 rounding on the GPU (each launch compiles its own order of the same sum). H200,
# Llama-3.1-8B heads, C = 1024, ℓ = 32 (docs/results/gpu-bench/2026-11-29-h200-saap-rank-forms.md): the probe at
# 32k batch 8 50.2 µs with the chunks, 40.0 with the scores and RANK_SPLIT; at 128k batch 1 24.0 against 27.2 (the
# extra launch costs more than the 8 programs' reads), hence "auto".
RANK_FORM = "auto"
RANK_FORMS = ("chunks", "scores", "auto")
RANK_SCORES_FROM = 32
# The scores form's comparisons: each rank program compares its CHUNK buckets with all C, B·Hkv·C² pairs a launch
# (67 M at batch 8, C = 1024), a few integer operations each. With RANK_SPLIT the index test of the tie rule leaves
# the [SUB, C] tile (one comparison and one add a pair) for a [SUB, SUB] one: the same ranks (the rank launch 16.5
# against 21.2 µs at 32k batch 8, H200).
RANK_SPLIT = True
# With the index update in the first launch, that launch lasts as long as its update items: each scans the C
# centroids TAIL_BLOCK_C at a time, one serial L2-latency-bound iteration per block (16 at C = 1024 and 64 a block:
# about 20 us a layer at 128k batch 1, where the hidden layer's own programs take a few). 128 a block halves the
# iterations; the launch then runs 8 warps so that the [128, d] float32 tile takes as many registers a thread
# as the [64, d] one at 4 warps.
TAIL_BLOCK_C = 128
TAIL_WARPS = 8
# The hidden layer: one program per (model, HIDDEN_TILE_H units, HIDDEN_TILE_R rows), 128 at batch 8 and hidden 256.
# A program's tile stays [16 rows, 32 units] whatever the batch: 159 registers a thread for sm_90 (Triton 3.9's
# ptxas), no spill, where a program over all 32 rows of batch 8 needs 255 and spills.
HIDDEN_TILE_H = 32
HIDDEN_TILE_R = 16


def fold_batchnorm(w1, b1, w2, b2, running_mean, running_var, gamma, beta, eps: float):
    """``(w1', b1', w2, b2)`` float32 with eval-mode BatchNorm (per model and hidden unit, flattened
    ``[M·H]`` as :class:`kvsieve.methods.saap.QueryClassifier` holds it) folded into the first map:
    ``BN(x·W1 + b1) = x·(W1·s) + (b1 − μ)·s + β`` with ``s = γ / sqrt(σ² + eps)``."""
    m, _, h = w1.shape
    w1, b1, w2, b2, running_mean, running_var, gamma, beta = (
        t.detach() for t in (w1, b1, w2, b2, running_mean, running_var, gamma, beta))
    s = (gamma.float() / torch.sqrt(running_var.float() + eps)).view(m, h)
    w1f = (w1.float() * s[:, None, :]).contiguous()
    b1f = ((b1.float() - running_mean.float().view(m, h)) * s + beta.float().view(m, h)).contiguous()
    return w1f, b1f, w2.float().contiguous(), b2.float().contiguous()


def serve_weights(w1, b1, w2, b2) -> tuple[torch.Tensor, ...]:
    """The folded classifier as the decode step reads it: ``w1'``, ``w2`` rounded to bfloat16 (half the
    bytes of the step's largest read), biases float32. Rounding the weights moves the logits by about
    2^-9 relative: it can reorder buckets whose scores nearly tie, nothing else. The kernels and the
    references take these same tensors."""
    return (w1.to(torch.bfloat16).contiguous(), b1.float().contiguous(), w2.to(torch.bfloat16).contiguous(),
            b2.float().contiguous())


def classifier_logits_reference(x, w1, b1, w2, b2) -> torch.Tensor:
    """``[M, R, C]`` logits of the folded classifier for ``x [M, R, d]`` (float32 arithmetic on the given
    weights, whatever their dtype)."""
    hidden = torch.relu(torch.baddbmm(b1.float()[:, None, :], x.float(), w1.float()))
    return torch.baddbmm(b2.float()[:, None, :], hidden, w2.float())


def derope_reference(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, Hq, d]`` float32 pre-RoPE queries (transformers' ``rotate_half`` layout): RoPE at position
    ``p`` is ``scaling`` times a rotation by ``p·inv_freq``, so its inverse rotates back and divides by
    ``scaling`` (the model's ``attention_scaling``)."""
    half = q.shape[-1] // 2
    freqs = positions.float()[:, None, None] * inv_freq.float().to(q.device)  # [B, 1, d/2]
    c, s = freqs.cos(), freqs.sin()
    y1, y2 = q.float()[..., :half], q.float()[..., half:]
    return torch.cat((y1 * c + y2 * s, y2 * c - y1 * s), dim=-1) / scaling


def probe_scores_reference(q, positions, inv_freq, scaling: float, w1, b1, w2, b2, kv_heads: int) -> torch.Tensor:
    """``[B, Hkv, C]``: the group sums of the classifier's softmax (folded weights, float32)."""
    b, hq, d = q.shape
    models = w1.shape[0]
    per = hq // models  # query heads per model: G per KV head, 1 per query head
    x = derope_reference(q, positions, inv_freq, scaling)
    xm = x.view(b, models, per, d).permute(1, 0, 2, 3).reshape(models, b * per, d)
    probs = torch.softmax(classifier_logits_reference(xm, w1, b1, w2, b2), dim=-1)  # [M, B·per, C]
    probs = probs.view(models, b, per, -1).permute(1, 0, 2, 3).reshape(b, hq, -1)
    return probs.view(b, kv_heads, hq // kv_heads, -1).sum(2)


if triton is not None:

    @triton.jit
    def _query_rows(q_ptr, pos_ptr, freq_ptr, scaling, rows, per, s_qb, s_qh, pos_offset, m, r0,
                    HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr):
        """``(x1, x2)`` float32 ``[BLOCK_R, HALF_P]``: the two halves of the de-roped queries of model ``m``'s rows
        ``r0 + [0, BLOCK_R)`` (row ``r`` is query head ``m·per + r % per`` of batch row ``r // per``, at
        ``positions[r // per] + pos_offset``)."""
        offs_r = r0 + tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, HALF_P)
        r_ok = offs_r < rows
        d_ok = offs_d < HALF
        b = offs_r // per
        head = m * per + offs_r % per
        base = q_ptr + b[:, None] * s_qb + head[:, None] * s_qh + offs_d[None, :]
        y1 = tl.load(base, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        y2 = tl.load(base + HALF, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        pos = (tl.load(pos_ptr + b, mask=r_ok, other=0) + pos_offset).to(tl.float32)
        freqs = pos[:, None] * tl.load(freq_ptr + offs_d, mask=d_ok, other=0.0)[None, :]
        c = tl.cos(freqs)
        s = tl.sin(freqs)
        return (y1 * c + y2 * s) / scaling, (y2 * c - y1 * s) / scaling

    @triton.jit
    def _w1_block(w1_ptr, b1_ptr, m, offs_h, hidden, HALF: tl.constexpr, HALF_P: tl.constexpr):
        """``(W1'[m, :d/2, block], W1'[m, d/2:, block], b1'[m, block])`` as stored (masked to ``hidden``)."""
        offs_d = tl.arange(0, HALF_P)
        h_ok = offs_h < hidden
        w_base = w1_ptr + m * (2 * HALF) * hidden + offs_d[:, None] * hidden + offs_h[None, :]
        w_ok = (offs_d < HALF)[:, None] & h_ok[None, :]
        return (tl.load(w_base, mask=w_ok, other=0.0), tl.load(w_base + HALF * hidden, mask=w_ok, other=0.0),
                tl.load(b1_ptr + m * hidden + offs_h, mask=h_ok, other=0.0))

    @triton.jit
    def _hidden_tile(x1, x2, w_top, w_bot, bias):
        """``relu(x·W1' + b1')`` for one block of hidden units: IEEE float32 products of the weights as given."""
        acc = (tl.dot(x1, w_top.to(tl.float32), input_precision="ieee")
               + tl.dot(x2, w_bot.to(tl.float32), input_precision="ieee"))
        return tl.maximum(acc + bias[None, :], 0.0)

    @triton.jit
    def _hidden_block(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h_ptr, scaling, rows, per, hidden, s_qb, s_qh,
                      pos_offset, pid, h_blocks, r_blocks,
                      HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program ``pid`` = (model ``m``, hidden block, row block) in that order: ``h[m, r, block] =
        relu(derope(q_r)·W1'[m, :, block] + b1'[m, block])`` for the ``BLOCK_R`` rows ``r`` of the row block; row
        ``r``'s query sits at ``positions[r // per] + pos_offset``."""
        m = pid // (h_blocks * r_blocks)
        h_block = (pid // r_blocks) % h_blocks
        r0 = (pid % r_blocks) * BLOCK_R
        offs_h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r = r0 + tl.arange(0, BLOCK_R)
        x1, x2 = _query_rows(q_ptr, pos_ptr, freq_ptr, scaling, rows, per, s_qb, s_qh, pos_offset, m, r0, HALF,
                             HALF_P, BLOCK_R)
        w_top, w_bot, bias = _w1_block(w1_ptr, b1_ptr, m, offs_h, hidden, HALF, HALF_P)
        acc = _hidden_tile(x1, x2, w_top, w_bot, bias)
        tl.store(h_ptr + (m * rows + offs_r[:, None]) * hidden + offs_h[None, :], acc,
                 mask=(offs_r < rows)[:, None] & (offs_h < hidden)[None, :])

    @triton.jit
    def _hidden_kernel(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h_ptr, scaling, rows, per, hidden, s_qb, s_qh,
                       pos_offset, h_blocks, r_blocks, hidden_programs,
                       tk_ptr, tc_ptr, tf_ptr, ta_ptr, tlo_ptr, tlen_ptr, twin_ptr, t_scaling, t_kv_heads, t_buckets,
                       t_span, t_skb, t_skh, t_skn, t_sab, t_sah,
                       HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                       TAIL: tl.constexpr, T_D: tl.constexpr,
                       T_HALF: tl.constexpr, T_BLOCK_C: tl.constexpr, T_DEROPE: tl.constexpr):
        """Programs ``[0, hidden_programs)``: :func:`_hidden_block` (model, hidden block, row block). With ``TAIL``
        the programs after them are the serial index update's work items
        (:func:`kvsieve.kernels.saap.index.assign_tail_program`, the ``t*`` arguments): the keys leaving the
        window join their buckets in this launch, one launch fewer per step."""
        pid = tl.program_id(0)
        if TAIL:
            if pid >= hidden_programs:
                item = pid - hidden_programs
                assign_tail_program(tk_ptr, tc_ptr, tf_ptr, ta_ptr, tlo_ptr, tlen_ptr, twin_ptr, t_scaling,
                                    t_kv_heads, t_buckets, t_span, t_skb, t_skh, t_skn, t_sab, t_sah,
                                    item // t_span, item % t_span, T_D, T_HALF, T_BLOCK_C, T_DEROPE)
            else:
                _hidden_block(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h_ptr, scaling, rows, per, hidden, s_qb,
                              s_qh, pos_offset, pid, h_blocks, r_blocks, HALF, HALF_P, BLOCK_R, BLOCK_H)
        else:
            _hidden_block(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h_ptr, scaling, rows, per, hidden, s_qb, s_qh,
                          pos_offset, pid, h_blocks, r_blocks, HALF, HALF_P, BLOCK_R, BLOCK_H)

    @triton.jit
    def _hidden_partial_kernel(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h_ptr, scaling, rows, per, hidden, s_qb,
                               s_qh, pos_offset, h_blocks, r_blocks, hidden_programs,
                               tk_ptr, tc_ptr, tf_ptr, tps_ptr, tpi_ptr, tlo_ptr, tlen_ptr, twin_ptr, t_scaling,
                               t_buckets, t_span, t_rows, t_c_blocks, t_r_blocks, t_skb, t_skh, t_skn,
                               HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_H: tl.constexpr, T_D: tl.constexpr,
                               T_HALF: tl.constexpr, T_BLOCK_C: tl.constexpr, T_BLOCK_R: tl.constexpr,
                               T_DEROPE: tl.constexpr):
        """:func:`_hidden_kernel` with the parallel update's first stage as the programs after the hidden ones
        (:func:`kvsieve.kernels.saap.index.assign_partial_program`, the ``t*`` arguments); its second stage runs in
        the rank launch."""
        pid = tl.program_id(0)
        if pid >= hidden_programs:
            assign_partial_program(tk_ptr, tc_ptr, tf_ptr, tps_ptr, tpi_ptr, tlo_ptr, tlen_ptr, twin_ptr, t_scaling,
                                   t_buckets, t_span, t_rows, t_c_blocks, t_r_blocks, t_skb, t_skh, t_skn,
                                   pid - hidden_programs, T_D, T_HALF, T_BLOCK_C, T_BLOCK_R, T_DEROPE)
        else:
            _hidden_block(q_ptr, pos_ptr, freq_ptr, w1_ptr, b1_ptr, h_ptr, scaling, rows, per, hidden, s_qb, s_qh,
                          pos_offset, pid, h_blocks, r_blocks, HALF, HALF_P, BLOCK_R, BLOCK_H)

    @triton.jit
    def _split3(x):
        """Three bfloat16 terms whose sum is the float32 ``x`` to 2^-24 relative (each takes the rounding
        error of the ones before)."""
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        return hi, mid, lo

    @triton.jit
    def _logits_acc(hb, wb, acc, W_BF16: tl.constexpr, DOT_F32: tl.constexpr):
        """``acc + hb·wb`` for float32 hidden rows ``hb``: against a bfloat16 ``wb`` three tensor-core products of
        :func:`_split3`'s terms with float32 accumulation (``DOT_F32``: the terms upcast, for the interpreter),
        else an IEEE float32 product."""
        if W_BF16:
            hi, mid, lo = _split3(hb)
            if DOT_F32:
                wf = wb.to(tl.float32)
                acc += tl.dot(lo.to(tl.float32), wf, input_precision="ieee")
                acc += tl.dot(mid.to(tl.float32), wf, input_precision="ieee")
                acc += tl.dot(hi.to(tl.float32), wf, input_precision="ieee")
            else:
                acc = tl.dot(lo, wb, acc, out_dtype=tl.float32)
                acc = tl.dot(mid, wb, acc, out_dtype=tl.float32)
                acc = tl.dot(hi, wb, acc, out_dtype=tl.float32)
        else:
            acc += tl.dot(hb, wb.to(tl.float32), input_precision="ieee")
        return acc

    @triton.jit
    def _logits_kernel(h_ptr, w2_ptr, b2_ptr, out_ptr, rows, hidden, buckets, k_per,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                       W_BF16: tl.constexpr, DOT_F32: tl.constexpr):
        """``part[s, m, r, c] = h[m, r, K_s]·W2[m, K_s, c] (+ b2[m, c] in part 0)`` for one block of buckets
        and one slice ``K_s = [s·k_per, (s + 1)·k_per)`` of the hidden units (``k_per`` a multiple of
        ``BLOCK_K``): the logits are the sum of the parts, which the softmax kernel takes. A bfloat16
        ``W2`` meets the float32 hidden rows split in three bfloat16 terms (:func:`_split3`): three
        tensor-core products with float32 accumulation, float32 accuracy. ``DOT_F32``: the interpreter
        (whose bfloat16 ``tl.dot`` is wrong) takes the same terms upcast."""
        m = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        part = tl.program_id(2)
        models = tl.num_programs(0)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rows
        c_ok = offs_c < buckets
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        k_lo = part * k_per
        for k0 in range(k_lo, tl.minimum(k_lo + k_per, hidden), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            hb = tl.load(h_ptr + (m * rows + offs_r[:, None]) * hidden + offs_k[None, :],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            wb = tl.load(w2_ptr + (m * hidden + offs_k[:, None]) * buckets + offs_c[None, :],
                         mask=k_ok[:, None] & c_ok[None, :], other=0.0)
            acc = _logits_acc(hb, wb, acc, W_BF16, DOT_F32)
        if part == 0:
            acc += tl.load(b2_ptr + m * buckets + offs_c, mask=c_ok, other=0.0)[None, :]
        tl.store(out_ptr + ((part * models + m) * rows + offs_r[:, None]) * buckets + offs_c[None, :], acc,
                 mask=r_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _group_rank_kernel(logits_ptr, out_ptr, top_ptr, rows, per, kv_heads, buckets, n_top, s_part, chunks,
                           rank_programs, rps_ptr, rpi_ptr, rassign_ptr, rlo_ptr, rlen_ptr, rwin_ptr, r_buckets,
                           r_span, r_rows, r_c_blocks, r_sab, r_sah,
                           GROUP: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                           PARTS: tl.constexpr, TOP: tl.constexpr, TAIL: tl.constexpr, R_BLOCKS_P: tl.constexpr):
        """Programs ``[0, rank_programs)``, (row·Hkv + KV head, chunk) = ``divmod(pid, chunks)``:
        ``scores[b, h, chunk] = Σ_g softmax(logits of query head h·G + g
        of row b)`` over the chunk's ``CHUNK`` buckets, the logits the sum of the logits kernel's ``PARTS``
        parts (``s_part`` elements apart); with ``TOP`` each of the chunk's buckets (``SUB`` a pass) whose rank is below
        ``n_top`` written to ``top[b, h, rank]``. The rank of bucket ``i`` is ``#{j: s_j > s_i or (s_j = s_i
        and j < i)}`` (``torch.topk``'s set, ties to the lower index, best first), counted against all C
        scores: no threshold search, no sort, no step that waits on another program. Every program of a
        (row, KV head) computes all C scores with the same code, so all agree on them to the bit, and
        takes its chunk's scores out of that vector (``tl.gather``) rather than computing them again. With
        ``TAIL`` the programs after them are the parallel index update's second stage
        (:func:`kvsieve.kernels.saap.index.assign_reduce_program`, the ``r*`` arguments)."""
        pid = tl.program_id(0)
        if TAIL:
            if pid >= rank_programs:
                assign_reduce_program(rps_ptr, rpi_ptr, rassign_ptr, rlo_ptr, rlen_ptr, rwin_ptr, r_buckets, r_span,
                                      r_rows, r_c_blocks, r_sab, r_sah, pid - rank_programs, R_BLOCKS_P)
            else:
                _rank_program(logits_ptr, out_ptr, top_ptr, rows, per, kv_heads, buckets, n_top, s_part, chunks, pid,
                              GROUP, BLOCK_C, CHUNK, SUB, PARTS, TOP)
        else:
            _rank_program(logits_ptr, out_ptr, top_ptr, rows, per, kv_heads, buckets, n_top, s_part, chunks, pid,
                          GROUP, BLOCK_C, CHUNK, SUB, PARTS, TOP)

    @triton.jit
    def _group_scores(logits_ptr, rows, per, buckets, s_part, b, kv,
                      GROUP: tl.constexpr, BLOCK_C: tl.constexpr, PARTS: tl.constexpr):
        """``[BLOCK_C]`` float32: ``Σ_g softmax`` of the logits of the group's query heads (row ``b``, KV head
        ``kv``), 0 past ``buckets``."""
        offs = tl.arange(0, BLOCK_C)
        ok = offs < buckets
        total = tl.zeros([BLOCK_C], dtype=tl.float32)
        for g in tl.static_range(0, GROUP):  # unrolled: the G·PARTS loads of the row issue together
            head = kv * GROUP + g
            m = head // per
            r = b * per + head % per
            z_ptr = logits_ptr + (m * rows + r) * buckets + offs
            z = tl.load(z_ptr, mask=ok, other=float("-inf"))
            for p in tl.static_range(1, PARTS):
                z += tl.load(z_ptr + p * s_part, mask=ok, other=0.0)
            e = tl.exp(z - tl.max(z, axis=0))
            total += e / tl.sum(e, axis=0)
        return total

    @triton.jit
    def _rank_program(logits_ptr, out_ptr, top_ptr, rows, per, kv_heads, buckets, n_top, s_part, chunks, pid,
                      GROUP: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                      PARTS: tl.constexpr, TOP: tl.constexpr):
        """:func:`_group_rank_kernel`'s program ``pid`` (a chunk of one row and KV head)."""
        bk = pid // chunks
        offs = tl.arange(0, BLOCK_C)
        ok = offs < buckets
        total = _group_scores(logits_ptr, rows, per, buckets, s_part, bk // kv_heads, bk % kv_heads, GROUP, BLOCK_C,
                              PARTS)
        # Non-negative floats order as their int32 bit patterns; padding (-1) is below every score.
        bits = tl.where(ok, total.to(tl.int32, bitcast=True), -1)
        for s0 in tl.static_range(0, CHUNK, SUB):  # SUB buckets a pass: a [SUB, BLOCK_C] comparison tile
            offs_i = (pid % chunks) * CHUNK + s0 + tl.arange(0, SUB)  # < BLOCK_C: CHUNK divides BLOCK_C
            ok_i = offs_i < buckets
            mine = tl.gather(total, offs_i, 0)
            tl.store(out_ptr + bk * buckets + offs_i, mine, mask=ok_i)
            if TOP:
                _rank_sub(top_ptr, bk, n_top, bits, offs, mine, offs_i, ok_i)

    @triton.jit
    def _rank_sub(top_ptr, bk, n_top, bits, offs, mine, offs_i, ok_i):
        """The ranks of the buckets ``offs_i`` (scores ``mine``) against all of the row's scores (``bits``: their
        int32 patterns, -1 past C), each below ``n_top`` written to ``top[bk, rank]``."""
        # Integers make "s_j > s_i, or s_j = s_i and j < i" one comparison: bits_j + [j < i] > bits_i.
        bits_i = mine.to(tl.int32, bitcast=True)
        beats = (bits[None, :] + (offs[None, :] < offs_i[:, None]).to(tl.int32)) > bits_i[:, None]
        rank = tl.sum(beats.to(tl.int32), axis=1)
        tl.store(top_ptr + bk * n_top + rank, offs_i.to(tl.int64), mask=ok_i & (rank < n_top))

    @triton.jit
    def _group_scores_kernel(logits_ptr, out_ptr, rows, per, kv_heads, buckets, s_part,
                             GROUP: tl.constexpr, BLOCK_C: tl.constexpr, PARTS: tl.constexpr):
        """``RANK_FORM = "scores"``'s first launch, one program per (batch row·Hkv + KV head): the group's C scores
        (:func:`_group_scores`, the code every program of the chunks form runs, at the same warps: the same
        reductions, the same bits) into ``scores[b, h]``."""
        bk = tl.program_id(0)
        offs = tl.arange(0, BLOCK_C)
        total = _group_scores(logits_ptr, rows, per, buckets, s_part, bk // kv_heads, bk % kv_heads, GROUP, BLOCK_C,
                              PARTS)
        tl.store(out_ptr + bk * buckets + offs, total, mask=offs < buckets)

    @triton.jit
    def _scores_rank_kernel(scores_ptr, top_ptr, buckets, n_top, chunks, rank_programs,
                            rps_ptr, rpi_ptr, rassign_ptr, rlo_ptr, rlen_ptr, rwin_ptr, r_buckets, r_span, r_rows,
                            r_c_blocks, r_sab, r_sah,
                            BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, SPLIT: tl.constexpr,
                            TAIL: tl.constexpr, R_BLOCKS_P: tl.constexpr):
        """``RANK_FORM = "scores"``'s rank launch: programs ``[0, rank_programs)``, (row·Hkv + KV head, chunk) =
        ``divmod(pid, chunks)``, read the row's C scores (4 KB at C = 1024, from L2) that
        :func:`_group_scores_kernel` wrote and rank their chunk's buckets as :func:`_rank_program` does
        (:func:`_rank_sub`; ``SPLIT``: :func:`_rank_split`, the same ranks); with ``TAIL`` the programs after them
        are the parallel index update's second stage, as in :func:`_group_rank_kernel`."""
        pid = tl.program_id(0)
        if TAIL:
            if pid >= rank_programs:
                assign_reduce_program(rps_ptr, rpi_ptr, rassign_ptr, rlo_ptr, rlen_ptr, rwin_ptr, r_buckets, r_span,
                                      r_rows, r_c_blocks, r_sab, r_sah, pid - rank_programs, R_BLOCKS_P)
            else:
                _rank_scores_program(scores_ptr, top_ptr, buckets, n_top, chunks, pid, BLOCK_C, CHUNK, SUB, SPLIT)
        else:
            _rank_scores_program(scores_ptr, top_ptr, buckets, n_top, chunks, pid, BLOCK_C, CHUNK, SUB, SPLIT)

    @triton.jit
    def _rank_scores_program(scores_ptr, top_ptr, buckets, n_top, chunks, pid,
                             BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, SPLIT: tl.constexpr):
        """:func:`_scores_rank_kernel`'s program ``pid`` (a chunk of one row and KV head)."""
        bk = pid // chunks
        offs = tl.arange(0, BLOCK_C)
        ok = offs < buckets
        row = scores_ptr + bk * buckets
        bits = tl.where(ok, tl.load(row + offs, mask=ok, other=0.0).to(tl.int32, bitcast=True), -1)
        for s0 in tl.static_range(0, CHUNK, SUB):
            p0 = (pid % chunks) * CHUNK + s0
            offs_i = p0 + tl.arange(0, SUB)
            ok_i = offs_i < buckets
            mine = tl.load(row + offs_i, mask=ok_i, other=0.0)
            if SPLIT:
                _rank_split(top_ptr, bk, n_top, bits, offs, mine, offs_i, ok_i, p0)
            else:
                _rank_sub(top_ptr, bk, n_top, bits, offs, mine, offs_i, ok_i)

    @triton.jit
    def _rank_split(top_ptr, bk, n_top, bits, offs, mine, offs_i, ok_i, p0):
        """:func:`_rank_sub`'s ranks of the pass's buckets ``offs_i = p0 + [0, SUB)`` at half its work a pair: every
        ``j < p0`` sits below each ``i`` and every ``j`` past the pass above it, so ``bits_j + [j < i]`` there is
        ``bits_j + [j < p0]``, one vector for the whole ``[SUB, C]`` tile (one comparison a pair, no index test); the
        ties to the lower index inside the pass are counted apart on a ``[SUB, SUB]`` tile."""
        bits_i = mine.to(tl.int32, bitcast=True)
        lifted = bits + (offs < p0).to(tl.int32)
        rank = tl.sum((lifted[None, :] > bits_i[:, None]).to(tl.int32), axis=1)
        # masked buckets of the pass (past C, read as 0) lie above every valid i: never "j < i"
        near = (bits_i[None, :] == bits_i[:, None]) & (offs_i[None, :] < offs_i[:, None])
        rank += tl.sum(near.to(tl.int32), axis=1)
        tl.store(top_ptr + bk * n_top + rank, offs_i.to(tl.int64), mask=ok_i & (rank < n_top))


def top_buckets_reference(scores: torch.Tensor, probes: int) -> torch.Tensor:
    """``[..., probes]`` int64: the kernel's top-ℓ — the ``probes`` largest scores, ties taken lowest index
    first, best first: the first ``probes`` of a stable descending sort (each bucket at its rank)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :probes]


def probe_scores_triton(q, positions, inv_freq, scaling: float, w1, b1, w2, b2, kv_heads: int,
                        probes: int = 0, position_offset: int = 0, tail: tuple | None = None,
                        parallel_tail: bool | None = None,
                        rank_form: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`probe_scores_reference` in three Triton launches, four where the rank form is ``"scores"`` (see the
    module docstring). With
    ``probes > 0`` also the ``[B, Hkv, probes]`` int64 best buckets from the last launch:
    :func:`top_buckets_reference` of the scores (``torch.topk``'s set, ties to the lower index, best
    first; the bucket kernel takes them in any order). The queries sit at ``positions +
    position_offset`` (added in the kernel: SAAP passes the lengths and -1, no launch for the sum).
    Weights as :func:`serve_weights` gives them (bfloat16 ``w1``, ``w2``) or float32. ``tail``: the arguments of
    :func:`kvsieve.kernels.saap.index.assign_tail_triton` (``assign, k, t_lo, lengths, window, span, centroids,
    inv_freq, scaling``), whose update then runs inside the probe's launches: the parallel one where
    ``parallel_tail`` (default :func:`kvsieve.kernels.saap.index.parallel_update` of the keys' batch), else the
    serial one. ``rank_form``: where the rank launch takes the group scores from (:data:`RANK_FORM`, its default;
    :func:`rank_form_for`)."""
    from ..shared.triton_utils import kernels_interpreted, next_pow2
    from .index import parallel_tail_args, parallel_update, tail_launch_args

    if triton is None:
        raise RuntimeError("probe_scores_triton needs triton")
    b, hq, d = q.shape
    models, _, hidden = w1.shape
    buckets = w2.shape[-1]
    if d % 2 or hq % models or hq % kv_heads or w1.shape[1] != d or w2.shape[1] != hidden:
        raise ValueError(f"q, w1, w2: shapes {tuple(q.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)} do not form "
                         "a classifier of one model per KV head or per query head")
    if isinstance(probes, bool) or not isinstance(probes, int) or not 0 <= probes <= buckets:
        raise ValueError(f"probes: expected an integer in [0, {buckets}], got {probes!r}")
    form = rank_form_for(b * kv_heads, RANK_FORM if rank_form is None else rank_form)
    if q.stride(-1) != 1:
        q = q.contiguous()
    per = hq // models
    rows = b * per
    block_r = max(16, next_pow2(rows))
    dev = q.device
    half = d // 2
    w_bf16 = w2.dtype == torch.bfloat16
    dot_f32 = w_bf16 and kernels_interpreted()
    common = dict(HALF=half, HALF_P=max(16, next_pow2(half)), BLOCK_R=block_r)
    query = (q, positions, inv_freq)
    # The logits GEMV reads all of W2 (16.8 MB in bfloat16 at Llama-3.1-8B shapes, hidden 1024): its speed is the
    # bytes in flight. The hidden units are cut in `parts` slices (the rank kernel adds the parts up).
    block_c, block_k = (64 if w_bf16 else 32), 32
    parts = max(1, min(4, triton.cdiv(hidden, block_k)))
    k_per = triton.cdiv(triton.cdiv(hidden, parts), block_k) * block_k
    parts = triton.cdiv(hidden, k_per)
    logits = torch.empty(parts, models, rows, buckets, device=dev, dtype=torch.float32)
    c_blocks = triton.cdiv(buckets, block_c)
    reduce_args, reduce_meta, reduce_items = (q,) * 6 + (1,) * 6, dict(BLOCKS_P=16), 0
    hid = torch.empty(models, rows, hidden, device=dev, dtype=torch.float32)
    hidden_r = max(16, min(HIDDEN_TILE_R, block_r))
    r_blocks = triton.cdiv(rows, hidden_r)
    h_blocks = triton.cdiv(hidden, HIDDEN_TILE_H)
    hidden_programs = models * h_blocks * r_blocks
    hidden_args = (*query, w1, b1, hid, float(scaling), rows, per, hidden, q.stride(0), q.stride(1),
                   int(position_offset), h_blocks, r_blocks, hidden_programs)
    hidden_meta = dict(common, BLOCK_R=hidden_r, BLOCK_H=HIDDEN_TILE_H)
    if tail is not None and (parallel_update(tail[1].shape[0]) if parallel_tail is None else parallel_tail):
        t = parallel_tail_args(*tail)
        reduce_args, reduce_meta, reduce_items = t.reduce_args, t.reduce_meta, t.reduce_items
        _hidden_partial_kernel[(hidden_programs + t.partial_items,)](
            *hidden_args, *t.partial_args, **hidden_meta,
            **{f"T_{k}": v for k, v in t.partial_meta.items()}, num_warps=4)
    else:
        if tail is None:
            t_args, t_meta, items = (q,) * 7 + (1.0,) + (1,) * 8, dict(D=16, HALF=8, BLOCK_C=16, DEROPE=False), 0
        else:
            t_args, t_meta, items = tail_launch_args(*tail, block_c=TAIL_BLOCK_C)
        _hidden_kernel[(hidden_programs + items,)](
            *hidden_args, *t_args, **hidden_meta, TAIL=tail is not None,
            **{f"T_{k}": v for k, v in t_meta.items()}, num_warps=4 if tail is None else TAIL_WARPS)
    # 64 buckets (128 bytes of a bfloat16 W2 row) a program, each streaming a 256 × 64 slice of W2 in 32-row tiles
    _logits_kernel[(models, c_blocks, parts)](
        hid, w2, b2, logits, rows, hidden, buckets, k_per, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_C=block_c,
        W_BF16=w_bf16, DOT_F32=dot_f32, num_warps=4, num_stages=4)
    scores = torch.empty(b, kv_heads, buckets, device=dev, dtype=torch.float32)
    top = torch.empty(b, kv_heads, max(probes, 1), device=dev, dtype=torch.int64)
    block_c = max(16, next_pow2(buckets))
    chunk = min(RANK_CHUNK, block_c)  # both powers of two: the chunks tile [0, BLOCK_C)
    sub = min(RANK_SUB, chunk)
    chunks = triton.cdiv(buckets, chunk)
    rank_programs = b * kv_heads * chunks
    s_part = models * rows * buckets
    r_meta = {f"R_{k}": v for k, v in reduce_meta.items()}
    if form == "chunks":
        _group_rank_kernel[(rank_programs + reduce_items,)](
            logits, scores, top, rows, per, kv_heads, buckets, probes, s_part, chunks, rank_programs,
            *reduce_args, GROUP=hq // kv_heads, BLOCK_C=block_c, CHUNK=chunk, SUB=sub, PARTS=parts, TOP=probes > 0,
            TAIL=reduce_items > 0, **r_meta, num_warps=RANK_WARPS)
        return (scores, top) if probes else scores
    # RANK_WARPS as the chunks form's programs: the same layout of the C scores, the same reduction order
    _group_scores_kernel[(b * kv_heads,)](logits, scores, rows, per, kv_heads, buckets, s_part, GROUP=hq // kv_heads,
                                          BLOCK_C=block_c, PARTS=parts, num_warps=RANK_WARPS)
    rank_programs = rank_programs if probes else 0  # the scores are written: without a top-ℓ only the update's work
    if rank_programs + reduce_items:
        _scores_rank_kernel[(rank_programs + reduce_items,)](
            scores, top, buckets, probes, chunks, rank_programs, *reduce_args, BLOCK_C=block_c, CHUNK=chunk, SUB=sub,
            SPLIT=bool(RANK_SPLIT), TAIL=reduce_items > 0, **r_meta, num_warps=RANK_WARPS)
    return (scores, top) if probes else scores


def top_of_scores_triton(scores: torch.Tensor, probes: int) -> torch.Tensor:
    """``[..., probes]`` int64: the scores form's rank launch alone on float32 scores ``[..., C]`` (non-negative, as
    the group sums are): :func:`top_buckets_reference` of them (with :data:`RANK_SPLIT` as set)."""
    from ..shared.triton_utils import next_pow2

    if triton is None:
        raise RuntimeError("top_of_scores_triton needs triton")
    if scores.dtype != torch.float32 or scores.dim() < 1:
        raise ValueError(f"scores: expected float32 [..., C], got {scores.dtype} {tuple(scores.shape)}")
    buckets = scores.shape[-1]
    if isinstance(probes, bool) or not isinstance(probes, int) or not 1 <= probes <= buckets:
        raise ValueError(f"probes: expected an integer in [1, {buckets}], got {probes!r}")
    flat = scores.reshape(-1, buckets).contiguous()
    top = torch.empty(flat.shape[0], probes, device=scores.device, dtype=torch.int64)
    if not flat.shape[0]:
        return top.view(*scores.shape[:-1], probes)
    block_c = max(16, next_pow2(buckets))
    chunk = min(RANK_CHUNK, block_c)
    chunks = triton.cdiv(buckets, chunk)
    _scores_rank_kernel[(flat.shape[0] * chunks,)](
        flat, top, buckets, probes, chunks, flat.shape[0] * chunks, *(flat,) * 6, *(1,) * 6, BLOCK_C=block_c,
        CHUNK=chunk, SUB=min(RANK_SUB, chunk), SPLIT=bool(RANK_SPLIT), TAIL=False, R_BLOCKS_P=16,
        num_warps=RANK_WARPS)
    return top.view(*scores.shape[:-1], probes)


def rank_form_for(pairs: int, rank_form: str) -> str:
    """``"chunks"`` or ``"scores"``: the form ``rank_form`` (one of :data:`RANK_FORMS`) takes for a batch of
    ``pairs`` (row, KV head) pairs; ``"auto"`` is ``"scores"`` from :data:`RANK_SCORES_FROM` pairs on."""
    if rank_form not in RANK_FORMS:
        raise ValueError(f"rank_form: expected one of {RANK_FORMS}, got {rank_form!r}")
    if rank_form == "auto":
        return "scores" if pairs >= RANK_SCORES_FROM else "chunks"
    return rank_form
