"""The `@triton.jit` code of the sparse decode attention (launched by `kernels/sparse_decode.py`):
the split kernel and the combine. The design: docs/kernels.md, "Sparse decode"."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .dot_modes import _dot


@triton.jit
def _tanh(x):
    """tanh from exp2 of -2|x| (no overflow at any x; no libdevice, so the interpreter runs it)."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, sinks_ptr,
    n_tokens, split_len, num_splits, qk_scale,  # qk_scale = softmax scale * log2(e)
    cap_in, cap_out,  # softcap: scale / softcap and softcap * log2(e)
    s_sn, s_sh,
    s_qn, s_qs, s_qh, s_qd,
    s_kp, s_kt, s_kh, s_kd,
    s_vp, s_vt, s_vh, s_vd,
    s_tn, s_tj,
    s_on, s_os, s_oh, s_od,
    HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PAGE: tl.constexpr, INDEXED: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
    V_FROM_K: tl.constexpr, QK_MODE: tl.constexpr, KDT: tl.constexpr, PV_MODE: tl.constexpr,
    VDT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """One program: sequence n, KV head h, one block of BLOCK_M of its G*S query rows (row
    r = query head h*G + r // S, query token r % S), the tokens [sp*split_len, (sp+1)*split_len)
    of split sp, in steps of BLOCK_N tokens. PDL: waits for the previous kernel first.
    SOFTCAP: logits cap * tanh(scale * q.k / cap). SINKS (never with SPLIT: the combine
    adds them, once): sinks[n, head] joins the denominator."""
    pdl.wait(PDL)
    ROWS: tl.constexpr = G * S
    ROW_BLOCKS: tl.constexpr = (ROWS + BLOCK_M - 1) // BLOCK_M
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    n = pid // (ROW_BLOCKS * HK)
    h = (pid // ROW_BLOCKS) % HK
    r = (pid % ROW_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < ROWS
    g = r // S
    s = r % S
    n64 = n.to(tl.int64)

    # the query rows, in two power-of-two chunks of the head dim (the second may be empty)
    q_row = q_ptr + n64 * s_qn + s * s_qs + (h * G + g) * s_qh
    da = tl.arange(0, BLOCK_DA)
    q_a = tl.load(q_row[:, None] + da[None, :] * s_qd, mask=row_ok[:, None] & (da[None, :] < D), other=0.0)
    if BLOCK_DB > 0:
        db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        q_b = tl.load(q_row[:, None] + db[None, :] * s_qd, mask=row_ok[:, None] & (db[None, :] < D), other=0.0)

    # how many tokens each row sees; padding rows see none
    if INDEXED:
        length = n_tokens
        limit = tl.where(row_ok, n_tokens, 0)
    else:
        length = tl.minimum(tl.load(lens_ptr + n).to(tl.int32), n_tokens)
        if CAUSAL:  # the newest S tokens are the query tokens: token s sees length - (S-1-s)
            limit = tl.where(row_ok, length - (S - 1 - s), 0)
        else:
            limit = tl.where(row_ok, length, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    dv = tl.arange(0, BLOCK_DV)
    start = sp * split_len
    end = tl.minimum(start + split_len, length)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        if INDEXED:  # row numbers into the cache viewed as [-1, Hk, D]
            row = tl.load(table_ptr + n64 * s_tn + t * s_tj, mask=t_ok, other=-1).to(tl.int64)
            t_ok = t_ok & (row >= 0)
            page = row // PAGE
            slot = row % PAGE
        else:  # the t-th token of the sequence's pages
            page = tl.load(table_ptr + n64 * s_tn + (t // PAGE) * s_tj, mask=t_ok, other=0).to(tl.int64)
            slot = t % PAGE
        k_rows = k_ptr + page * s_kp + slot * s_kt + h * s_kh
        k_a = tl.load(k_rows[:, None] + da[None, :] * s_kd, mask=t_ok[:, None] & (da[None, :] < D), other=0.0)
        qk = _dot(q_a, tl.trans(k_a.to(KDT)), QK_MODE)
        if BLOCK_DB > 0:
            k_b = tl.load(k_rows[:, None] + db[None, :] * s_kd, mask=t_ok[:, None] & (db[None, :] < D), other=0.0)
            qk += _dot(q_b, tl.trans(k_b.to(KDT)), QK_MODE)
        seen = t_ok[None, :] & (t[None, :] < limit[:, None])
        if SOFTCAP:
            qk = tl.where(seen, _tanh(qk * cap_in) * cap_out, float("-inf"))
        else:
            qk = tl.where(seen, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_FROM_K:  # MLA: V is the first chunk of the K rows just loaded
            v = k_a
        else:
            v_rows = v_ptr + page * s_vp + slot * s_vt + h * s_vh
            v = tl.load(v_rows[:, None] + dv[None, :] * s_vd, mask=t_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(VDT), v.to(VDT), PV_MODE)
        m_i = m_new

    if SINKS:  # the sink's exp joins the denominator; its max may be the row's max
        sink = tl.load(sinks_ptr + n64 * s_sn + (h * G + g) * s_sh, mask=row_ok, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
        alpha = tl.exp2(m_i - m_f)
        l_f = l_i * alpha + tl.exp2(sink - m_f)
        o = acc * alpha[:, None] / tl.where(l_f > 0, l_f, 1.0)[:, None]
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that saw nothing: zeros
    out_mask = row_ok[:, None] & (dv[None, :] < DV)
    if SPLIT:
        # workspace rows [(n, h, r), split]: the normalised partial output and its log2-sum-exp2
        ws = ((n64 * HK + h) * ROWS + r) * num_splits + sp
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1.0)), float("-inf"))  # l >= 1 once seen
        tl.store(part_ptr + ws[:, None] * DV + dv[None, :], o, mask=out_mask)
        tl.store(lse_ptr + ws, lse, mask=row_ok)
    else:
        out_row = out_ptr + n64 * s_on + s * s_os + (h * G + g) * s_oh
        tl.store(out_row[:, None] + dv[None, :] * s_od, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, sinks_ptr, num_splits,
    s_on, s_os, s_oh, s_od, s_sn, s_sh,
    HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, DV: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr, SINKS: tl.constexpr,
):
    """One program per query row (n, h, r): out = Σ_i 2^(lse_i - max) o_i / Σ_i 2^(lse_i - max);
    splits that saw nothing have lse -inf and weigh 0; a row that saw nothing gets zeros.
    SINKS: the row's sink (log2 units: sink * log2(e)) joins the max and the denominator,
    here and only here, so that it counts once whatever the number of splits."""
    pdl.wait(PDL)
    ROWS: tl.constexpr = G * S
    pid = tl.program_id(0)
    r = pid % ROWS
    h = (pid // ROWS) % HK
    n = pid // (ROWS * HK)
    base = pid.to(tl.int64) * num_splits
    i = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(lse_ptr + base + i, mask=i < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + n.to(tl.int64) * s_sn + (h * G + r // S) * s_sh).to(tl.float32)
        sink = sink * 1.4426950408889634
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp2(lse - top), axis=0)
    if SINKS:
        total += tl.exp2(sink - top)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for j in range(num_splits):  # one split at a time: [splits, 512] at once would not fit registers
        w = tl.exp2(tl.load(lse_ptr + base + j) - top)
        acc += w * tl.load(part_ptr + (base + j) * DV + dv, mask=dv < DV, other=0.0)
    o = acc / tl.where(total > 0, total, 1.0)
    out_row = out_ptr + n.to(tl.int64) * s_on + (r % S) * s_os + (h * G + r // S) * s_oh
    tl.store(out_row + dv * s_od, o.to(out_ptr.dtype.element_ty), mask=dv < DV)
