"""The Triton kernels of ``hfnative.models.triton_kernels`` and of the decode step's ``hfnative.models.triton_decode``
(which say what each computes, where and why they run).
Imported at first use: Triton reads ``TRITON_INTERPRET`` when a kernel is defined."""

import triton
import triton.language as tl

# Triton specialises a kernel's integer arguments: a value of 1, a multiple of 16 and any other each compile a
# variant of their own. A launch's row count follows the batch's tokens (a batch of 112 tokens after batches of 124
# compiled the norm kernels again in the middle of training); the kernels read it only to mask the rows past the
# end, where the specialisation buys nothing (loads vectorise over a row's columns, masked by the width, a model's
# constant). The gated unit's element count stays specialised: it is a multiple of 16 wherever the width is, and its
# mask runs over the contiguous elements.
ROW_COUNTS = ("n_rows",)


@triton.jit
def _normed(x, rstd, w, offset, LIKE, LLAMA: tl.constexpr):
    """x * rstd scaled by the weight, in float32: Llama's (the normed value cast to LIKE's dtype, the normed input's,
    then times w) or normed * (offset + w)."""
    if LLAMA:
        return (x * rstd).to(LIKE.dtype.element_ty).to(tl.float32) * w
    return x * rstd * (offset + w)


@triton.jit
def _rotated(y, y_partner, cos, sin, first_half, OUT, ROUNDED: tl.constexpr):
    """y * cos + rotate_half(y) * sin (y_partner: y at each column's partner; first_half: where rotate_half negates
    it), in float32, or with ROUNDED as torch rotates in OUT's dtype: the inputs, each product and the sum rounded to
    it (the caller stores the result in OUT's dtype)."""
    rotated_partner = tl.where(first_half, -y_partner, y_partner)
    if ROUNDED:
        y = y.to(OUT.dtype.element_ty).to(tl.float32)
        rotated_partner = rotated_partner.to(OUT.dtype.element_ty).to(tl.float32)
        return ((y * cos).to(OUT.dtype.element_ty).to(tl.float32)
                + (rotated_partner * sin).to(OUT.dtype.element_ty).to(tl.float32))
    return y * cos + rotated_partner * sin


@triton.jit(do_not_specialize=ROW_COUNTS)
def rms_norm_forward(X, R, H, W, Y, RSTD, COS, SIN, n_rows, n_cols, heads, eps, offset,
                     LLAMA: tl.constexpr, ROPE: tl.constexpr, ADD: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, ROUNDED: tl.constexpr = False):
    """The norm of H: of X itself (H is X), or with ADD of X + R, written to H (the residual stream's sum, rounded
    to H's dtype before it is normed). ROPE: the normed heads rotated, in float32, or with ROUNDED (tables in Y's
    dtype) as torch rotates in that dtype: the normed heads, each product and the sum rounded to it."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_rows = rows < n_rows
    mask = in_rows[:, None] & (cols < n_cols)[None, :]
    at = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        h = (x + tl.load(R + at, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + at, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
    tl.store(RSTD + rows[:, None], rstd, mask=in_rows[:, None])
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y = _normed(x, rstd, w, offset, H, LLAMA)
    if ROPE:  # then rotated, each row a head of the token at row // heads
        half = n_cols // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        x_partner = tl.load(X + rows[:, None] * n_cols + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        w_partner = tl.load(W + partner, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        at_token = (rows // heads)[:, None] * n_cols + cols[None, :]
        cos = tl.load(COS + at_token, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(SIN + at_token, mask=mask, other=0.0).to(tl.float32)
        y = _rotated(y, _normed(x_partner, rstd, w_partner, offset, X, LLAMA), cos, sin, (cols < half)[None, :], Y,
                     ROUNDED)
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=ROW_COUNTS)
def rms_norm_backward(DY, DY2, DY3, DH, X, W, RSTD, COS, SIN, DX, DR, DW, n_rows, n_cols, heads, offset,
                      LLAMA: tl.constexpr, ROPE: tl.constexpr, GRADS: tl.constexpr, RESIDUAL: tl.constexpr,
                      UPDATE_GRAD: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr,
                      WEIGHT_GRAD: tl.constexpr, ROUNDED: tl.constexpr = False):
    """The gradient of the norm's input X (from its output's GRADS gradients); with RESIDUAL plus DH, the residual
    stream's own gradient of X, added as autograd adds it (the norm's rounded to X's dtype first), and with
    UPDATE_GRAD that sum also written to DR in DR's dtype (the residual update's gradient). ROPE with ROUNDED: the
    rotation's transpose as autograd runs it in DY's dtype (each product's gradient and their sum rounded to it)."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for tile in range(TILES):  # TILES tiles of ROWS rows a program, the weight's gradient summed over them
        rows = (program.to(tl.int64) * TILES + tile) * ROWS + tl.arange(0, ROWS)
        in_rows = rows < n_rows
        mask = in_rows[:, None] & (cols < n_cols)[None, :]
        at = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + at, mask=mask, other=0.0).to(tl.float32)
        if GRADS > 1:  # the output fanned out to several layers: their gradients summed in float32
            dy += tl.load(DY2 + at, mask=mask, other=0.0).to(tl.float32)
        if GRADS > 2:
            dy += tl.load(DY3 + at, mask=mask, other=0.0).to(tl.float32)
        if ROPE:  # the rotation's transpose first: dy * cos + (dy * sin) at the partner, its sign flipped
            half = n_cols // 2
            partner = tl.where(cols < half, cols + half, cols - half)
            at_token = (rows // heads)[:, None] * n_cols
            dy_partner = tl.load(DY + rows[:, None] * n_cols + partner[None, :], mask=mask, other=0.0)
            sin_partner = tl.load(SIN + at_token + partner[None, :], mask=mask, other=0.0)
            cos = tl.load(COS + at_token + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy_sin = dy_partner.to(tl.float32) * sin_partner.to(tl.float32)
            if ROUNDED:
                dy_sin = dy_sin.to(DY.dtype.element_ty).to(tl.float32)
                dy = ((dy * cos).to(DY.dtype.element_ty).to(tl.float32)
                      + tl.where((cols < half)[None, :], dy_sin, -dy_sin)).to(DY.dtype.element_ty).to(tl.float32)
            else:
                dy = dy * cos + tl.where((cols < half)[None, :], dy_sin, -dy_sin)
        rstd = tl.load(RSTD + rows, mask=in_rows, other=0.0)[:, None]
        normed = x * rstd
        if LLAMA:
            if WEIGHT_GRAD:
                dw += tl.sum(dy * normed.to(X.dtype.element_ty).to(tl.float32), axis=0)
            grad_normed = (dy * w).to(X.dtype.element_ty).to(tl.float32)
        else:
            if WEIGHT_GRAD:
                dw += tl.sum(dy * normed, axis=0)
            grad_normed = dy * (offset + w)
        # d(x * rstd)/dx applied to g: rstd * (g - normed * mean(g * normed))
        dx = rstd * (grad_normed - normed * (tl.sum(grad_normed * normed, axis=1) / n_cols)[:, None])
        if RESIDUAL:
            dx = dx.to(DX.dtype.element_ty).to(tl.float32) + tl.load(DH + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)
        if UPDATE_GRAD:
            tl.store(DR + at, dx.to(DX.dtype.element_ty).to(DR.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(DW + program * n_cols + cols, dw, mask=cols < n_cols)


@triton.jit
def silu_gated_forward(G, U, Y, n, n_cols, g_stride, u_stride, BLOCK: tl.constexpr):
    """Y = silu(G) * U over n elements, rows of n_cols: Y's contiguous, G's and U's rows g_stride and u_stride apart
    (n_cols where contiguous; twice it for the two halves of one fused gate-and-up product)."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    row, col = at // n_cols, at % n_cols
    g = tl.load(G + row * g_stride + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * u_stride + col, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)  # F.silu, in the gate's dtype
    tl.store(Y + at, (silu * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def silu_gated_backward(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    dy = tl.load(DY + at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
    sigmoid = 1.0 / (1.0 + tl.exp(-g))
    silu = (g * sigmoid).to(G.dtype.element_ty).to(tl.float32)
    tl.store(DU + at, (silu * dy).to(DU.dtype.element_ty), mask=mask)
    dy_u = (dy * u).to(G.dtype.element_ty).to(tl.float32)  # grad_out * up, in the gate's dtype
    # aten.silu_backward: grad * sigmoid * (1 + x * (1 - sigmoid))
    tl.store(DG + at, (dy_u * sigmoid * (1.0 + g * (1.0 - sigmoid))).to(DG.dtype.element_ty), mask=mask)


@triton.jit
def _rotation_tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's rows of heads and their columns, the mask, each column's partner in rotate_half, and whether
    the column is in the first half (where rotate_half negates the partner)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    half = n_cols // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    return rows, cols, mask, partner, (cols < half)[None, :]


@triton.jit(do_not_specialize=ROW_COUNTS)
def rope_forward(X, Y, COS, SIN, n_rows, n_cols, heads, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                 ROUNDED: tl.constexpr = False):
    rows, cols, mask, partner, first_half = _rotation_tile(n_rows, n_cols, ROWS, BLOCK)
    x = tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(X + rows[:, None] * n_cols + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    at_token = (rows // heads)[:, None] * n_cols + cols[None, :]
    cos = tl.load(COS + at_token, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + at_token, mask=mask, other=0.0).to(tl.float32)
    # in float32, cast to x's dtype once; ROUNDED (tables in x's dtype): in that dtype (x itself rounds to itself)
    y = _rotated(x, x_partner, cos, sin, first_half, Y, ROUNDED)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=ROW_COUNTS)
def rope_backward(DY, DX, COS, SIN, n_rows, n_cols, heads, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, cols, mask, partner, first_half = _rotation_tile(n_rows, n_cols, ROWS, BLOCK)
    dy = tl.load(DY + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy_partner = tl.load(DY + rows[:, None] * n_cols + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    at_token = (rows // heads)[:, None] * n_cols
    cos = tl.load(COS + at_token + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sin_partner = tl.load(SIN + at_token + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    # autograd's: each product's gradient cast to x's dtype, then their sum (the rotation's transpose on the second)
    through_cos = (dy * cos).to(DX.dtype.element_ty).to(tl.float32)
    through_sin = (dy_partner * sin_partner).to(DX.dtype.element_ty).to(tl.float32)
    dx = through_cos + tl.where(first_half, through_sin, -through_sin)
    tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _decode_head(X, W, COS, SIN, OUT, cols, mask, eps, offset, n_cols, NORM: tl.constexpr, LLAMA: tl.constexpr,
                 ROUNDED: tl.constexpr):
    """One head [1, BLOCK] of a decode step's query or key projection at X: normed by W (NORM, as
    ``rms_norm_forward`` norms a row) and rotated by the token's tables as there (``_rotated``); returned in float32
    (the caller stores it in OUT's dtype). Without NORM, ROUNDED rounds X's values to OUT's dtype, their own."""
    half = n_cols // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    x = tl.load(X + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(X + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        w_partner = tl.load(W + partner, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        x = _normed(x, rstd, w, offset, X, LLAMA)
        x_partner = _normed(x_partner, rstd, w_partner, offset, X, LLAMA)
    cos = tl.load(COS + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return _rotated(x, x_partner, cos, sin, (cols < half)[None, :], OUT, ROUNDED)


@triton.jit
def decode_qkv(Q, K, V, QW, KW, COS, SIN, Q_OUT, K_CACHE, V_CACHE, ENTRY, q_stride, k_stride, v_stride, heads,
               kv_heads, n_cols, cache_b, cache_h, cache_l, eps, offset, NORM: tl.constexpr, LLAMA: tl.constexpr,
               ROUNDED: tl.constexpr, BLOCK: tl.constexpr):
    """A decode step's query, key and value heads (one token a row, each projection's rows ``*_stride`` apart: three
    projections or slices of one) in one launch, a head a program: the query heads normed and rotated into Q_OUT
    [B, heads, d], the key heads normed and rotated into the key cache and the value heads copied into the value
    cache, both at entry ENTRY (a device scalar) of [B, kv_heads, L, d] buffers with strides cache_b/h/l."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = (cols < n_cols)[None, :]
    if head < heads:
        y = _decode_head(Q + token * q_stride + head * n_cols, QW, COS + token * n_cols, SIN + token * n_cols, Q_OUT,
                         cols, mask, eps, offset, n_cols, NORM, LLAMA, ROUNDED)
        tl.store(Q_OUT + (token * heads + head) * n_cols + cols[None, :], y.to(Q_OUT.dtype.element_ty), mask=mask)
    else:
        entry = tl.load(ENTRY).to(tl.int64)
        if head < heads + kv_heads:
            kv_head = head - heads
            y = _decode_head(K + token * k_stride + kv_head * n_cols, KW, COS + token * n_cols, SIN + token * n_cols,
                             K_CACHE, cols, mask, eps, offset, n_cols, NORM, LLAMA, ROUNDED)
            at = token * cache_b + kv_head * cache_h + entry * cache_l
            tl.store(K_CACHE + at + cols[None, :], y.to(K_CACHE.dtype.element_ty), mask=mask)
        else:
            kv_head = head - heads - kv_heads
            v = tl.load(V + token * v_stride + kv_head * n_cols + cols[None, :], mask=mask, other=0.0)
            at = token * cache_b + kv_head * cache_h + entry * cache_l
            tl.store(V_CACHE + at + cols[None, :], v.to(V_CACHE.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=("length",))  # the cache's length: a call's prompt slots + new tokens, read for rings
def decode_attention(Q, K_CACHE, V_CACHE, OUT, PAD, SLOT, ENTRY_SLOT, PART_ACC, PART_MAX, PART_SUM, q_b, q_h, cache_b,
                     cache_h, cache_l, out_b, out_h, group, n_cols, length, scale, FULL: tl.constexpr,
                     GROUP_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     SPLITS: tl.constexpr):
    """One query a row against a layer's key/value cache [B, kv_heads, L, d], a program a row and key/value head: its
    ``group`` query heads of Q [B, heads, d] (rows q_b apart, heads q_h) attend, with an online softmax in float32,
    to the entries the row may see, written to OUT likewise. FULL (a buffer holding every slot, entry e at slot e):
    entries PAD[row] .. SLOT (a device scalar: the slot this step wrote), and nothing past them is read; else a
    ring of ``length`` entries, each seen where the slot it holds (ENTRY_SLOT, -1 when empty) is at or after the
    row's padding. The probabilities meet the values in the values' dtype, as a flash kernel's do; IEEE: float32
    products (no TF32). SPLITS > 1: the entries are read in that many consecutive parts, a program each (the grid's
    third axis), each leaving its unnormalised sum, running max and softmax total [GROUP_BLOCK(, BLOCK_D)] in
    PART_ACC / PART_MAX / PART_SUM for ``decode_attention_combine``."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    members = tl.arange(0, GROUP_BLOCK)
    heads = kv_head * group + members
    cols = tl.arange(0, BLOCK_D)
    in_cols = cols < n_cols
    q_mask = (members < group)[:, None] & in_cols[None, :]
    q = tl.load(Q + row * q_b + heads[:, None] * q_h + cols[None, :], mask=q_mask, other=0.0)
    pad = tl.load(PAD + row).to(tl.int32)
    if FULL:
        first = pad
        end = tl.load(SLOT).to(tl.int32) + 1
    else:
        first = pad * 0
        end = first + length
    if SPLITS > 1:  # this program's part: whole blocks, the last part shorter (or empty)
        part = ((end - first + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        first = first + tl.program_id(2) * part
        end = tl.minimum(end, first + part)
    # the row's and head's entries: offsets within them in int32 (a tile's addresses held as 32-bit offsets)
    K_CACHE += row * cache_b + kv_head * cache_h
    V_CACHE += row * cache_b + kv_head * cache_h
    row_max = tl.full([GROUP_BLOCK], -float("inf"), tl.float32)
    total = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, BLOCK_D], tl.float32)
    for start in range(first, end, BLOCK_N):
        entries = start + tl.arange(0, BLOCK_N)
        seen = entries < end
        if not FULL:
            seen = seen & (tl.load(ENTRY_SLOT + entries, mask=seen, other=-1) >= pad)
        at = entries[:, None] * cache_l + cols[None, :]
        kv_mask = seen[:, None] & in_cols[None, :]
        k = tl.load(K_CACHE + at, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(seen[None, :], scores * scale, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # a block a row sees nothing of (a ring's empty or padded entries) leaves it as it was
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        rescale = tl.exp(row_max - shift)
        p = tl.exp(scores - shift[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(V_CACHE + at, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(OUT + row * out_b + heads[:, None] * out_h + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=q_mask)
    else:
        at_part = ((row * tl.num_programs(1) + kv_head) * SPLITS + tl.program_id(2)) * GROUP_BLOCK + members
        tl.store(PART_MAX + at_part, row_max)
        tl.store(PART_SUM + at_part, total)
        tl.store(PART_ACC + at_part[:, None] * BLOCK_D + cols[None, :], acc)


@triton.jit
def decode_attention_combine(PART_ACC, PART_MAX, PART_SUM, OUT, out_b, out_h, group, n_cols, SPLITS: tl.constexpr,
                             GROUP_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``decode_attention``'s SPLITS parts of a row's and key/value head's attention joined (a program each): each
    part's sum rescaled to the largest running max, over the total so rescaled, written to OUT [B, heads, d]."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    members = tl.arange(0, GROUP_BLOCK)
    cols = tl.arange(0, BLOCK_D)
    row_max = tl.full([GROUP_BLOCK], -float("inf"), tl.float32)
    total = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, BLOCK_D], tl.float32)
    for split in tl.static_range(SPLITS):
        at_part = ((row * tl.num_programs(1) + kv_head) * SPLITS + split) * GROUP_BLOCK + members
        part_max = tl.load(PART_MAX + at_part)
        new_max = tl.maximum(row_max, part_max)
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # (a part that read nothing weighs 0)
        rescale, weight = tl.exp(row_max - shift), tl.exp(part_max - shift)
        total = total * rescale + tl.load(PART_SUM + at_part) * weight
        acc = acc * rescale[:, None] + tl.load(PART_ACC + at_part[:, None] * BLOCK_D + cols[None, :]) * weight[:, None]
        row_max = new_max
    heads = kv_head * group + members
    mask = (members < group)[:, None] & (cols < n_cols)[None, :]
    out = acc / total[:, None]
    tl.store(OUT + row * out_b + heads[:, None] * out_h + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def cross_entropy_rows(Z, TARGETS, VALID, GRAD, LOSS, ENTROPY, CORRECT, n_cols, stride_z, stride_grad, scale,
                       WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """One row of a chunk's logits z = Z * scale: its NLL, entropy and top-1 hit (masked by VALID), and, with
    WRITE_GRAD, dNLL/dz = softmax(z) - onehot(target) (times VALID) in GRAD's dtype. Two passes over the row: an
    online max / sum / expectation / argmax, then the gradient. BLOCKS: the row's blocks of BLOCK entries (the
    vocabulary's, fixed for a model)."""
    row = tl.program_id(0).to(tl.int64)
    # a target outside the vocabulary (never passed: ignored rows come with target 0 and VALID 0) reads no memory
    # outside the row
    target = tl.minimum(tl.maximum(tl.load(TARGETS + row), 0), n_cols - 1)
    valid = tl.load(VALID + row).to(tl.float32)
    offsets = tl.arange(0, BLOCK)
    row_max = -float("inf")
    total = 0.0  # sum of exp(z - row_max)
    weighted = 0.0  # sum of exp(z - row_max) * z
    best = 0  # the first index of the row's maximum, as torch.max and argmax choose it
    for block in range(BLOCKS):
        cols = block * BLOCK + offsets
        mask = cols < n_cols
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=-float("inf")).to(tl.float32) * scale
        block_max = tl.max(z, axis=0)
        block_best = tl.min(tl.where(z == block_max, cols, n_cols), axis=0)
        best = tl.where(block_max > row_max, block_best, best)
        new_max = tl.maximum(row_max, block_max)
        rescale = tl.exp(row_max - new_max)
        e = tl.where(mask, tl.exp(z - new_max), 0.0)
        total = total * rescale + tl.sum(e, axis=0)
        weighted = weighted * rescale + tl.sum(e * tl.where(mask, z, 0.0), axis=0)
        row_max = new_max
    log_z = row_max + tl.log(total)
    target_logit = tl.load(Z + row * stride_z + target).to(tl.float32) * scale
    # an ignored row adds nothing, even where its logits are not finite
    tl.store(LOSS + row, tl.where(valid > 0, (log_z - target_logit) * valid, 0.0))
    tl.store(ENTROPY + row, tl.where(valid > 0, (log_z - weighted / total) * valid, 0.0))
    tl.store(CORRECT + row, ((best == target) & (valid > 0)).to(tl.int32))
    if WRITE_GRAD:
        for block in range(BLOCKS):
            cols = block * BLOCK + offsets
            mask = cols < n_cols
            z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32) * scale
            grad = tl.exp(z - log_z) - tl.where(cols == target, 1.0, 0.0)
            grad = tl.where(valid > 0, grad * valid, 0.0)
            tl.store(GRAD + row * stride_grad + cols, grad.to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def int8_dequantize(DATA, ABSMAX, OUT, n_cols, inv_max, BLOCK: tl.constexpr):
    """A quantized base's int8 rows as the weight they stand for: ``DATA * ABSMAX[row]`` then ``* inv_max`` (1/127),
    each product rounded in float32 as torch's two multiplies are, the result rounded once to OUT's dtype. A program
    a row (axis 0) and block of its columns (axis 1)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    values = tl.load(DATA + row * n_cols + cols, mask=mask, other=0).to(tl.float32) * tl.load(ABSMAX + row)
    tl.store(OUT + row * n_cols + cols, (values * inv_max).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def nf4_dequantize(DATA, SCALERS, FACTORS, MEAN, TABLE, OUT, n_pairs, HALF_BLOCK: tl.constexpr,
                   SCALER_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """An NF4 weight (torchao's ``NF4Tensor``) as its values: each byte of DATA holds two 4-bit indices into TABLE (the
    first element in the high bits), a block of ``2 * HALF_BLOCK`` elements shares one double-quantized scale,
    ``SCALERS[block] / FACTORS[block // SCALER_BLOCK] + MEAN``. Every step rounds to the table's dtype where torchao's
    ``get_original_weight`` rounds (the quotient, the sum, the product), then to OUT's dtype; the division is IEEE's
    (``div_rn``: a GPU's plain ``/`` may be a faster approximation)."""
    pairs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = pairs < n_pairs
    byte = tl.load(DATA + pairs, mask=mask, other=0).to(tl.int32)
    block = pairs // HALF_BLOCK
    scale = tl.math.div_rn(tl.load(SCALERS + block, mask=mask, other=0).to(tl.float32),
                           tl.load(FACTORS + block // SCALER_BLOCK, mask=mask, other=1.0).to(tl.float32))
    scale = scale.to(TABLE.dtype.element_ty).to(tl.float32)
    scale = (scale + tl.load(MEAN).to(tl.float32)).to(TABLE.dtype.element_ty).to(tl.float32)
    first = tl.load(TABLE + (byte >> 4), mask=mask, other=0.0).to(tl.float32) * scale
    second = tl.load(TABLE + (byte & 15), mask=mask, other=0.0).to(tl.float32) * scale
    first = first.to(TABLE.dtype.element_ty).to(OUT.dtype.element_ty)
    second = second.to(TABLE.dtype.element_ty).to(OUT.dtype.element_ty)
    at = tl.program_id(0).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(OUT + at, tl.interleave(first, second), mask=at < 2 * n_pairs.to(tl.int64))
