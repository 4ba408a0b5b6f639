//! Causal self-attention, fused: the scores, the mask, the softmax and the
//! weighted sum of the values in one op, from the packed `q | k | v`
//! projection to the heads' concatenated outputs, without a `T x T` tensor
//! (FlashAttention's scheme: only two numbers per query are kept for the
//! backward, which recomputes the weights from them).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::kernel::{each_item, per_float, Float};

/// Causal multi-head self-attention from a packed projection: `qkv` is
/// `(batch, T, 3 W)`, the queries, keys and values one after the other
/// along the last dimension (GPT-2's `c_attn` output), each split into
/// `heads` heads of `W / heads` columns. Returns `(batch, T, W)`, the
/// heads' outputs side by side: per head `softmax(q k^T / sqrt(d) +
/// mask) v`, with the causal mask (query `i` sees keys `0..=i`), as
/// PyTorch's `scaled_dot_product_attention(q, k, v, is_causal=True)`
/// followed by `transpose(1, 2).reshape(batch, T, W)`.
///
/// Fused on CPU f32/f64: no `T x T` tensor is kept, and none is made
/// whole. Four queries at a time, their scores, the softmax and the
/// weighted sum of the values are computed in one pass per head, and only
/// each query's largest scaled score and sum of exponentials are kept for
/// the backward, which recomputes the weights from them, 64 queries at a
/// time, and gives the queries', keys' and values' gradients in one pass
/// (FlashAttention's scheme; the masked half of the scores is never
/// computed). The products run in register tiles, compiled for AVX2 and
/// FMA as well and picked at run time where the CPU has them. Elsewhere
/// (CUDA, bf16/f16) it is candle's ops, [`causal_attention_unfused`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// // One sequence of 3 positions, 2 heads of 2: q, k and v side by side.
/// let qkv = Tensor::randn(0f32, 1.0, (1, 3, 12), &Device::Cpu)?;
/// let y = candle_dp::ops::causal_attention(&qkv, 2)?;
/// assert_eq!(y.dims(), &[1, 3, 4]);
/// // The first position sees only itself: its output is its value.
/// let first = y.get(0)?.get(0)?.to_vec1::<f32>()?;
/// let value = qkv.get(0)?.get(0)?.narrow(0, 8, 4)?.to_vec1::<f32>()?;
/// assert!(first.iter().zip(&value).all(|(a, b)| (a - b).abs() < 1e-6));
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// An input that is not `(batch, T, 3 W)` with `W` a multiple of `heads`,
/// no heads, or no positions or columns (`T` or `W` 0).
pub fn causal_attention(qkv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    Heads::of(qkv.dims(), heads)?;
    match (qkv.device().is_cpu(), qkv.dtype()) {
        (true, DType::F32 | DType::F64) => qkv.contiguous()?.apply_op1(CausalAttention {
            heads,
            stats: Mutex::new(None),
        }),
        _ => causal_attention_unfused(qkv, heads),
    }
}

/// The sizes of an attention input: `batch`, `t` positions, `width` W (the
/// output's last dimension), `heads` of `d` columns.
#[derive(Debug, Clone, Copy)]
struct Heads {
    batch: usize,
    t: usize,
    width: usize,
    heads: usize,
    d: usize,
}

impl Heads {
    fn of(dims: &[usize], heads: usize) -> candle_core::Result<Self> {
        let &[batch, t, packed] = dims else {
            candle_core::bail!(
                "causal attention: an input of shape {dims:?}, not (batch, positions, 3 x width)"
            );
        };
        if heads == 0 || packed % 3 != 0 || (packed / 3) % heads != 0 {
            candle_core::bail!(
                "causal attention: a last dimension of {packed} is not q, k and v of {heads} \
                 head(s) each (input {dims:?})"
            );
        }
        let width = packed / 3;
        if t == 0 || width == 0 {
            candle_core::bail!(
                "causal attention: an input of shape {dims:?} has no positions or no columns"
            );
        }
        Ok(Self {
            batch,
            t,
            width,
            heads,
            d: width / heads,
        })
    }

    fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }

    /// The element of `qkv` (`part` 0 for q, 1 for k, 2 for v) at position
    /// `i` of sequence `b`, head `h`, column 0.
    fn packed_at(&self, part: usize, b: usize, h: usize, i: usize) -> usize {
        (b * self.t + i) * 3 * self.width + part * self.width + h * self.d
    }
}

/// [`causal_attention`] in candle's ops alone, on any device and dtype:
/// the heads split out, `softmax(q k^T / sqrt(d) + mask) v` (the mask of
/// [`causal_mask`](super::causal_mask) added, candle-nn's softmax), the
/// heads side by side again. What the fused op falls back to where it has
/// no kernel, and what it is checked and measured against.
///
/// # Errors
///
/// As [`causal_attention`]'s.
pub fn causal_attention_unfused(qkv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let s = Heads::of(qkv.dims(), heads)?;
    let part = |k: usize| -> candle_core::Result<Tensor> {
        qkv.narrow(2, k * s.width, s.width)?
            .reshape((s.batch, s.t, s.heads, s.d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let scores = (q.matmul(&k.t()?.contiguous()?)? * s.scale())?;
    let masked = scores.broadcast_add(&super::causal_mask(s.t, &scores)?)?;
    let weights = candle_nn::ops::softmax(&masked, candle_core::D::Minus1)?;
    weights
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((s.batch, s.t, s.width))
}

/// The forward op. It keeps each query's [`STATS`] (`batch x heads x T`
/// pairs, as storage of the input's dtype) for its backward: candle's
/// `CustomOp1` has one output, and the statistics belong to this
/// application of the op alone (a new one is made for every call).
struct CausalAttention {
    heads: usize,
    stats: Mutex<Option<CpuStorage>>,
}

/// The backward: `(qkv, dy) -> dqkv`, given the forward's statistics.
struct CausalAttentionGrad {
    heads: usize,
    stats: CpuStorage,
}

/// Rows of a product tile (see [`tile`]).
const ROWS: usize = 4;
/// Columns of a product tile: 8 f32 are one AVX register.
const LANES: usize = 8;

/// A row-major matrix whose rows are `stride` long, padded with zeros to
/// whole tiles: the kernels read and write whole tiles without a bound
/// to check per element.
struct Matrix<T> {
    values: Vec<T>,
    stride: usize,
}

impl<T: Float> Matrix<T> {
    /// `rows x cols` zeros, both rounded up to whole [`LANES`] (a multiple
    /// of [`ROWS`]).
    fn zeros(rows: usize, cols: usize) -> Self {
        let stride = cols.div_ceil(LANES) * LANES;
        Self {
            values: vec![T::of(0.0); rows.div_ceil(LANES) * LANES * stride],
            stride,
        }
    }

    fn row(&self, i: usize) -> &[T] {
        &self.values[i * self.stride..(i + 1) * self.stride]
    }

    fn row_mut(&mut self, i: usize) -> &mut [T] {
        &mut self.values[i * self.stride..(i + 1) * self.stride]
    }

    /// The transpose of the first `rows` rows and `cols` columns, padded.
    fn transposed(&self, rows: usize, cols: usize) -> Self {
        let mut out = Self::zeros(cols, rows);
        for i in 0..rows {
            for (j, &v) in self.row(i)[..cols].iter().enumerate() {
                out.values[j * out.stride + i] = v;
            }
        }
        out
    }
}

/// How a [`tile`] reads its left-hand matrix.
#[derive(Clone, Copy)]
enum Read {
    /// `a[row][k]`: the product with `a`.
    Rows,
    /// `a[k][row]`: the product with `a`'s transpose, read in place.
    Columns,
}

/// A `ROWS x LANES` tile of a matrix product: `acc[r][l] = sum over n <
/// len of a[a_row + r][a_k + n] * b[b_k + n][col + l]` (`a[a_k + n][a_row
/// + r]` with [`Read::Columns`]), summed in order of `n`. The tile stays
/// in registers and each element of `b` read is used `ROWS` times, which
/// is what lets these loops run near the machine's arithmetic speed
/// instead of its memory's. With `fma` (known when the caller was
/// compiled: see [`head_forward`]) each step is one fused multiply-add.
#[inline(always)]
fn tile<T: Float>(
    (a, read, a_row, a_k): (&Matrix<T>, Read, usize, usize),
    (b, b_k, col): (&Matrix<T>, usize, usize),
    len: usize,
    fma: bool,
) -> [[T; LANES]; ROWS] {
    let mut acc = [[T::of(0.0); LANES]; ROWS];
    let b_rows = b.values[b_k * b.stride..(b_k + len) * b.stride].chunks_exact(b.stride);
    // The arrays below are written out for four rows.
    const _: () = assert!(ROWS == 4);
    match read {
        Read::Rows => {
            let row = |r: usize| &a.row(a_row + r)[a_k..a_k + len];
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            for (n, bk) in b_rows.enumerate() {
                step(
                    &mut acc,
                    [r0[n], r1[n], r2[n], r3[n]],
                    &bk[col..col + LANES],
                    fma,
                );
            }
        }
        Read::Columns => {
            let a_rows = a.values[a_k * a.stride..(a_k + len) * a.stride].chunks_exact(a.stride);
            for (ak, bk) in a_rows.zip(b_rows) {
                let xs = &ak[a_row..a_row + ROWS];
                step(
                    &mut acc,
                    [xs[0], xs[1], xs[2], xs[3]],
                    &bk[col..col + LANES],
                    fma,
                );
            }
        }
    }
    acc
}

/// One step of a [`tile`]: `acc[r] += xs[r] * b` (inlined into the
/// caller's target, where `mul_add` is one instruction; not inlined, it
/// would be a library call).
#[inline(always)]
fn step<T: Float>(acc: &mut [[T; LANES]; ROWS], xs: [T; ROWS], b: &[T], fma: bool) {
    for (acc, x) in acc.iter_mut().zip(xs) {
        for (o, &v) in acc.iter_mut().zip(b) {
            *o = if fma { x.mul_add(v, *o) } else { *o + x * v };
        }
    }
}

/// One head's `T x d` queries (`part` 0), keys (1) or values (2) of one
/// sequence, gathered from the packed input, padded.
fn head_part<T: Float>(qkv: &[T], s: Heads, (b, h): (usize, usize), part: usize) -> Matrix<T> {
    let mut m = Matrix::zeros(s.t, s.d);
    for i in 0..s.t {
        let at = s.packed_at(part, b, h, i);
        m.row_mut(i)[..s.d].copy_from_slice(&qkv[at..at + s.d]);
    }
    m
}

/// This head's `T x d` rows of a `(batch, T, W)` tensor (an output or its
/// gradient), padded.
fn head_rows<T: Float>(m: &[T], s: Heads, b: usize, h: usize) -> Matrix<T> {
    let mut out = Matrix::zeros(s.t, s.d);
    for i in 0..s.t {
        let at = (b * s.t + i) * s.width + h * s.d;
        out.row_mut(i)[..s.d].copy_from_slice(&m[at..at + s.d]);
    }
    out
}

/// What the backward needs of a query's softmax, two numbers per query
/// (`[max, sum]`): its largest scaled score and the sum of the
/// exponentials of its scaled scores less that. The backward recomputes
/// the very exponentials the forward summed (the same products, the same
/// bits) and divides by that sum. With a log-sum-exp alone
/// (FlashAttention's one number, `max + ln(sum)` rounded), the f32
/// gradients of the PyTorch fixture (`tests/suite/ops.rs`) came out
/// 2.3e-6 from the exact values instead of 9.6e-7 (candle's composite
/// ops: 3.5e-7).
const STATS: usize = 2;

/// One head of one sequence forward: its `T x d` output (`out`) and each
/// query's statistics (`stats`, [`STATS`] numbers per query). Four
/// queries at a time: their scores against the keys they see, the
/// softmax, the weighted sum of the values.
#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
fn head_forward<T: Float>(
    (q, kt, v): (&Matrix<T>, &Matrix<T>, &Matrix<T>),
    s: Heads,
    out: &mut [T],
    stats: &mut [T],
) {
    let (t, d, scale) = (s.t, s.d, T::of(s.scale()));
    let fma = multiversion::target::target_cfg_f!(target_feature = "fma");
    let mut p = Matrix::zeros(ROWS, t);
    for i0 in (0..t).step_by(ROWS) {
        // The keys the last of these queries sees.
        let n = (i0 + ROWS).min(t);
        for jb in (0..n).step_by(LANES) {
            let scores = tile((q, Read::Rows, i0, 0), (kt, 0, jb), d, fma);
            for (r, scores) in scores.iter().enumerate() {
                p.row_mut(r)[jb..jb + LANES].copy_from_slice(scores);
            }
        }
        let mut sums = [T::of(1.0); ROWS];
        for (r, sum) in sums.iter_mut().enumerate() {
            let (i, row) = (i0 + r, p.row_mut(r));
            if i >= t {
                row.fill(T::of(0.0));
                continue;
            }
            let seen = &mut row[..=i];
            let max = seen.iter().fold(T::NEG_INFINITY, |m, &v| m.max(scale * v));
            seen.iter_mut().for_each(|v| *v = (scale * *v - max).exp());
            *sum = seen.iter().copied().sum::<T>();
            row[i + 1..].fill(T::of(0.0));
            stats[STATS * i..STATS * (i + 1)].copy_from_slice(&[max, *sum]);
        }
        for cb in (0..d).step_by(LANES) {
            let values = tile((&p, Read::Rows, 0, 0), (v, 0, cb), n, fma);
            for (r, (values, &sum)) in values.iter().zip(&sums).enumerate() {
                let i = i0 + r;
                if i < t {
                    let cols = LANES.min(d - cb);
                    let o = &mut out[i * d + cb..i * d + cb + cols];
                    o.iter_mut().zip(values).for_each(|(o, &v)| *o = v / sum);
                }
            }
        }
    }
}

/// Queries per block of the backward: the weights and their gradient are
/// made for this many queries at a time (`QUERY_BLOCK x T` each), never
/// for the whole `T x T`.
const QUERY_BLOCK: usize = 64;

/// One head of one sequence backward, from its output's gradient `dout`
/// and the statistics. Per block of queries: the weights `p = exp(scale q
/// k^T - max) / sum` recomputed with their gradient `dp = dout v^T`, then
/// `ds = p (dp - rowsum(p dp)) scale`, `dq = ds k`, `dv += p^T dout`, `dk
/// += ds^T q`. Writes `dq`, `dk`, `dv` (`T x d` each) into `grads`.
///
/// `rowsum(p dp)` equals `rowsum(dout o)` (FlashAttention's cheaper form,
/// which needs no row of weights whole), but the output `o` is rounded:
/// with it, the fixture's f32 gradients came out 1.6e-6 from the exact
/// values instead of 9.6e-7 (candle's composite ops, whose softmax
/// backward sums over the weights too: 3.5e-7).
#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
fn head_backward<T: Float>(
    (q, k, kt, vt): (&Matrix<T>, &Matrix<T>, &Matrix<T>, &Matrix<T>),
    s: Heads,
    (dout, stats): (&Matrix<T>, &[T]),
    grads: &mut [T],
) {
    let (t, d, scale) = (s.t, s.d, T::of(s.scale()));
    let fma = multiversion::target::target_cfg_f!(target_feature = "fma");
    let (mut dk, mut dv) = (Matrix::zeros(t, d), Matrix::zeros(t, d));
    let (mut p, mut ds) = (Matrix::zeros(QUERY_BLOCK, t), Matrix::zeros(QUERY_BLOCK, t));
    let (dq, rest) = grads.split_at_mut(t * d);
    for blk in (0..t).step_by(QUERY_BLOCK) {
        let here = QUERY_BLOCK.min(t - blk);
        for i0 in (0..here).step_by(ROWS) {
            let n = (blk + i0 + ROWS).min(t);
            for jb in (0..n).step_by(LANES) {
                let scores = tile((q, Read::Rows, blk + i0, 0), (kt, 0, jb), d, fma);
                let dp = tile((dout, Read::Rows, blk + i0, 0), (vt, 0, jb), d, fma);
                for r in 0..ROWS {
                    let i = blk + i0 + r;
                    if i >= t {
                        break;
                    }
                    // A whole tile at a time (vector code), then the keys
                    // this query does not see set to 0; `dp` waits in `ds`.
                    let mut pr = [T::of(0.0); LANES];
                    let (max, sum) = (stats[STATS * i], stats[STATS * i + 1]);
                    for (w, &score) in pr.iter_mut().zip(&scores[r]) {
                        *w = (scale * score - max).exp() / sum;
                    }
                    let seen = (i + 1).saturating_sub(jb).min(LANES);
                    pr[seen..].fill(T::of(0.0));
                    p.row_mut(i0 + r)[jb..jb + LANES].copy_from_slice(&pr);
                    ds.row_mut(i0 + r)[jb..jb + LANES].copy_from_slice(&dp[r]);
                }
            }
            let cols = n.div_ceil(LANES) * LANES;
            for r in 0..ROWS.min(t - (blk + i0)) {
                let (w, g) = (&p.row(i0 + r)[..cols], &mut ds.row_mut(i0 + r)[..cols]);
                let delta = w.iter().zip(g.iter()).map(|(&w, &g)| w * g).sum::<T>();
                g.iter_mut()
                    .zip(w)
                    .for_each(|(g, &w)| *g = w * (*g - delta) * scale);
            }
            for cb in (0..d).step_by(LANES) {
                let grad = tile((&ds, Read::Rows, i0, 0), (k, 0, cb), n, fma);
                for (r, grad) in grad.iter().enumerate() {
                    let i = blk + i0 + r;
                    if i < t {
                        let cols = LANES.min(d - cb);
                        dq[i * d + cb..i * d + cb + cols].copy_from_slice(&grad[..cols]);
                    }
                }
            }
        }
        // Keys `j` get gradient from the block's queries `i >= j`.
        let seen = blk + here;
        for j0 in (0..seen).step_by(ROWS) {
            let from = j0.saturating_sub(blk);
            for cb in (0..d).step_by(LANES) {
                let len = here - from;
                let grad_v = tile(
                    (&p, Read::Columns, j0, from),
                    (dout, blk + from, cb),
                    len,
                    fma,
                );
                let grad_k = tile(
                    (&ds, Read::Columns, j0, from),
                    (q, blk + from, cb),
                    len,
                    fma,
                );
                for r in 0..ROWS {
                    let (vr, kr) = (&mut dv.row_mut(j0 + r)[cb..cb + LANES], grad_k[r]);
                    vr.iter_mut().zip(grad_v[r]).for_each(|(a, g)| *a = *a + g);
                    let kr_out = &mut dk.row_mut(j0 + r)[cb..cb + LANES];
                    kr_out.iter_mut().zip(kr).for_each(|(a, g)| *a = *a + g);
                }
            }
        }
    }
    let (dk_out, dv_out) = rest.split_at_mut(t * d);
    for i in 0..t {
        dk_out[i * d..(i + 1) * d].copy_from_slice(&dk.row(i)[..d]);
        dv_out[i * d..(i + 1) * d].copy_from_slice(&dv.row(i)[..d]);
    }
}

/// Every head of every sequence forward: `(y, stats)`, `y` `(batch, T,
/// W)` and `stats` `(batch, heads, T, STATS)`.
fn forward<T: Float>(qkv: &[T], s: Heads) -> (Vec<T>, Vec<T>) {
    let (t, d) = (s.t, s.d);
    // Each head's rows in a slot of its own (heads in parallel), placed
    // side by side in the output after.
    let mut slots = vec![T::of(0.0); s.batch * s.heads * t * d];
    let mut stats = vec![T::of(0.0); s.batch * s.heads * t * STATS];
    let items: Vec<_> = slots
        .chunks_mut(t * d)
        .zip(stats.chunks_mut(t * STATS))
        .enumerate()
        .collect();
    each_item(items, work(s), |(n, (out, stats))| {
        let (b, h) = (n / s.heads, n % s.heads);
        // What the forward reads: q, k transposed (`d x T`, so that the
        // tiles run along keys), v.
        let part = |p| head_part(qkv, s, (b, h), p);
        let kt = part(1).transposed(t, d);
        head_forward((&part(0), &kt, &part(2)), s, out, stats);
    });
    let mut y = vec![T::of(0.0); s.batch * t * s.width];
    for (n, slot) in slots.chunks(t * d).enumerate() {
        let (b, h) = (n / s.heads, n % s.heads);
        for (i, row) in slot.chunks(d).enumerate() {
            let at = (b * t + i) * s.width + h * d;
            y[at..at + d].copy_from_slice(row);
        }
    }
    (y, stats)
}

/// Every head backward: the gradient of `qkv`, packed as `qkv`.
fn backward<T: Float>(qkv: &[T], dy: &[T], stats: &[T], s: Heads) -> Vec<T> {
    let (t, d) = (s.t, s.d);
    let mut slots = vec![T::of(0.0); s.batch * s.heads * 3 * t * d];
    let items: Vec<_> = slots.chunks_mut(3 * t * d).enumerate().collect();
    each_item(items, work(s), |(n, grads)| {
        let (b, h) = (n / s.heads, n % s.heads);
        let dout = head_rows(dy, s, b, h);
        let stats = &stats[n * t * STATS..(n + 1) * t * STATS];
        // What the backward reads: q, k, and k and v transposed.
        let part = |p| head_part(qkv, s, (b, h), p);
        let (k, vt) = (part(1), part(2).transposed(t, d));
        let kt = k.transposed(t, d);
        head_backward((&part(0), &k, &kt, &vt), s, (&dout, stats), grads);
    });
    let mut dqkv = vec![T::of(0.0); qkv.len()];
    for (n, slot) in slots.chunks(3 * t * d).enumerate() {
        let (b, h) = (n / s.heads, n % s.heads);
        for (part, grads) in slot.chunks(t * d).enumerate() {
            for (i, row) in grads.chunks(d).enumerate() {
                let at = s.packed_at(part, b, h, i);
                dqkv[at..at + d].copy_from_slice(row);
            }
        }
    }
    dqkv
}

/// The scores a pass computes, for [`each_item`]'s choice of running on
/// the calling thread.
fn work(s: Heads) -> usize {
    s.batch * s.heads * s.t * s.t * s.d / 2
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "candle-dp-causal-attention"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "causal attention";
        let s = Heads::of(layout.dims(), self.heads)?;
        let (y, stats) = per_float!(storage.dtype(), op, T => {
            let (y, stats) = forward(T::slice(storage, layout, op)?, s);
            (T::storage(y), T::storage(stats))
        });
        // A poisoned lock only means another thread panicked holding it;
        // the value is replaced whole either way.
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(stats);
        Ok((y, Shape::from((s.batch, s.t, s.width))))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let saved = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(stats) = saved else {
            candle_core::bail!("causal attention backward: the forward kept no statistics");
        };
        let grad = qkv.apply_op2_no_bwd(
            &grad_res.contiguous()?,
            &CausalAttentionGrad {
                heads: self.heads,
                stats,
            },
        )?;
        Ok(Some(grad))
    }
}

impl CustomOp2 for CausalAttentionGrad {
    fn name(&self) -> &'static str {
        "candle-dp-causal-attention-grad"
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        qkv_layout: &Layout,
        dy: &CpuStorage,
        dy_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "causal attention backward";
        let s = Heads::of(qkv_layout.dims(), self.heads)?;
        if dy_layout.dims() != [s.batch, s.t, s.width] {
            candle_core::bail!(
                "{op}: a gradient of shape {:?} for an input of shape {:?}",
                dy_layout.dims(),
                qkv_layout.dims()
            );
        }
        let stats_layout = Layout::contiguous(s.batch * s.heads * s.t * STATS);
        let out = per_float!(qkv.dtype(), op, T => T::storage(backward(
            T::slice(qkv, qkv_layout, op)?,
            T::slice(dy, dy_layout, op)?,
            T::slice(&self.stats, &stats_layout, op)?,
            s,
        )));
        Ok((out, qkv_layout.shape().clone()))
    }
}
