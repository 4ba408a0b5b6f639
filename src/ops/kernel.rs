//! What the fused ops' CPU kernels share: the element types, reading a
//! contiguous input, and splitting a kernel's work over the rayon pool.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout};

/// Evaluates `$body` with the type `$t` the element type of `$dtype` (f32
/// or f64: the types with fused kernels); an error naming `$op` for any
/// other dtype.
macro_rules! per_float {
    ($dtype:expr, $op:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            other => candle_core::bail!("{}: no fused kernel for {:?}", $op, other),
        }
    };
}
pub(super) use per_float;

/// A contiguous layout's elements of `slice`, or an error naming `op`.
pub(super) fn elements<'a, T>(
    slice: &'a [T],
    layout: &Layout,
    op: &str,
) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&slice[start..end]),
        None => candle_core::bail!("{op}: a strided input (make it contiguous first)"),
    }
}

/// The element types with fused kernels (f32, f64).
///
/// f32's `exp` and `tanh` are branch-free formulas the compiler turns into
/// vector code (libm's `expf` and `tanhf` are scalar calls, which made the
/// language model's GELU a tenth of its step): within 2e-7 relative
/// (`exp`) and 1.2e-7 absolute (`tanh`) of libm's. f64's are std's.
pub(super) trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::iter::Sum
{
    const NEG_INFINITY: Self;
    /// The elements of `storage` (contiguous, in `layout`) if it holds this
    /// type; an error naming `op` and the dtype it holds otherwise.
    fn slice<'a>(
        storage: &'a CpuStorage,
        layout: &Layout,
        op: &str,
    ) -> candle_core::Result<&'a [Self]>;
    /// `values` as a candle storage.
    fn storage(values: Vec<Self>) -> CpuStorage;
    /// The values `storage` owns, if it holds this type; an error naming
    /// `op` and the dtype it holds otherwise.
    fn into_values(storage: CpuStorage, op: &str) -> candle_core::Result<Vec<Self>>;
    fn of(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// `(tanh x, 1 - tanh^2 x)`.
    fn tanh_and_sech2(self) -> (Self, Self);
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
    fn ln(self) -> Self;
    fn max(self, other: Self) -> Self;
    /// `self * a + b` rounded once (a fused multiply-add: one instruction
    /// where the CPU has it, a slow library call where it does not; see
    /// its use in the attention's kernels).
    fn mul_add(self, a: Self, b: Self) -> Self;
}

/// The parts of [`Float`] that f32 and f64 implement alike: reading and
/// making candle storages, conversions, `ln` and `max`.
macro_rules! float_common {
    ($t:ty, $variant:ident) => {
        const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
        fn slice<'a>(
            storage: &'a CpuStorage,
            layout: &Layout,
            op: &str,
        ) -> candle_core::Result<&'a [Self]> {
            match storage {
                CpuStorage::$variant(values) => elements(values, layout, op),
                other => candle_core::bail!("{op}: {:?} beside {}", other.dtype(), stringify!($t)),
            }
        }
        fn storage(values: Vec<Self>) -> CpuStorage {
            CpuStorage::$variant(values)
        }
        fn into_values(storage: CpuStorage, op: &str) -> candle_core::Result<Vec<Self>> {
            match storage {
                CpuStorage::$variant(values) => Ok(values),
                other => candle_core::bail!("{op}: {:?} beside {}", other.dtype(), stringify!($t)),
            }
        }
        fn of(v: f64) -> Self {
            v as $t
        }
        fn to_f64(self) -> f64 {
            f64::from(self)
        }
        fn ln(self) -> Self {
            <$t>::ln(self)
        }
        fn max(self, other: Self) -> Self {
            <$t>::max(self, other)
        }
        fn mul_add(self, a: Self, b: Self) -> Self {
            <$t>::mul_add(self, a, b)
        }
    };
}

impl Float for f32 {
    float_common!(f32, F32);
    fn tanh_and_sech2(self) -> (Self, Self) {
        // With q = 2 / (e^(2|x|) + 1) = 1 - |tanh x|: 1 - tanh^2 x = q (2 -
        // q), without the cancellation of 1 - t * t where |t| is near 1
        // (there the GELU's derivative multiplies it by up to 20).
        let q = 2.0 / (exp_f32(2.0 * self.abs().min(44.0)) + 1.0);
        ((1.0 - q).copysign(self), q * (2.0 - q))
    }
    fn exp(self) -> Self {
        exp_f32(self)
    }
    fn tanh(self) -> Self {
        // tanh |x| = 1 - 2 / (e^(2|x|) + 1), e^88 being near f32's largest.
        let e = exp_f32(2.0 * self.abs().min(44.0));
        (1.0 - 2.0 / (e + 1.0)).copysign(self)
    }
}

impl Float for f64 {
    float_common!(f64, F64);
    fn tanh_and_sech2(self) -> (Self, Self) {
        // PyTorch's order of operations (f64 has digits to spare).
        let t = self.tanh();
        (t, 1.0 - t * t)
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
}

/// `e^x` in f32 without a branch or a call: `x = n ln 2 + r` with `n`
/// rounded to the nearest integer (`|r| <= ln 2 / 2`), `e^r` by its Taylor
/// series to `r^7` (truncation under 6e-9), times `2^n` built in the
/// exponent bits. Below -87 it is 0 (`e^-87` is near the smallest normal
/// f32), above 88 it is `e^88`; NaN stays NaN. Integer work only on bits
/// (no float-to-integer cast, whose saturation keeps the compiler from
/// vectorising).
fn exp_f32(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that `n * LN2_HI` is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5 * 2^23 rounds to the nearest integer (any |v| < 2^22) and
    // leaves it in the low bits of the sum; subtracting it gives `n` as a
    // float.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.0, 88.0);
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // `n + 127` in the exponent field: the sum's low bits hold `n`.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    let y = p * scale;
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

/// Below this many elements of work a kernel runs on the calling thread
/// alone (candle's own threshold for its elementwise pool).
const PARALLEL_MIN: usize = 64 * 1024;

/// Runs `f` on every item: on the current rayon pool, where candle's
/// matmul runs too (a Fabric's rank or replica: its own pool, of its share
/// of the cores; elsewhere the global pool, `RAYON_NUM_THREADS`), or on
/// the calling thread when that pool has one thread or `work` (the
/// elements the items touch) is small. Each item's result is the same
/// whichever thread runs it, so a kernel's bytes do not depend on the
/// thread count.
///
/// Each item runs through [`run`], compiled for AVX2 as well: the kernels'
/// loops become 8-wide vector code where the CPU has it, with the same
/// bits (no operation is fused or reordered).
pub(super) fn each_item<I: Send>(items: Vec<I>, work: usize, f: impl Fn(I) + Sync + Send) {
    use rayon::iter::{IntoParallelIterator, ParallelIterator};
    if work < PARALLEL_MIN || rayon::current_num_threads() <= 1 {
        items.into_iter().for_each(|item| run(&f, item));
        return;
    }
    items.into_par_iter().for_each(|item| run(&f, item));
}

/// `f(item)`, in a function compiled for AVX2 as well and picked at run
/// time, into which `f` (a kernel's loop over its block) is inlined.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn run<I, F: Fn(I)>(f: &F, item: I) {
    f(item)
}

/// Rows per block of the row-wise kernels: the unit of work handed to a
/// thread, and of the partial sums reduced over rows (summed in block
/// order, so that the result is the same on any number of threads).
pub(super) const BLOCK_ROWS: usize = 32;

/// Elements per item of the element-wise kernels.
const CHUNK: usize = 16 * 1024;

/// `f(a[i])` for every element, in parallel when large; written as a zip
/// over slices so that the compiler vectorises `f`.
pub(super) fn map1<T: Float>(a: &[T], f: impl Fn(T) -> T + Sync + Send) -> Vec<T> {
    let mut out = vec![T::of(0.0); a.len()];
    let items: Vec<_> = out.chunks_mut(CHUNK).zip(a.chunks(CHUNK)).collect();
    each_item(items, a.len(), |(out, a)| {
        for (o, &a) in out.iter_mut().zip(a) {
            *o = f(a);
        }
    });
    out
}

/// `f(a[i], b[i])` for every element (`a` and `b` of one length), in
/// parallel when large.
pub(super) fn map2<T: Float>(a: &[T], b: &[T], f: impl Fn(T, T) -> T + Sync + Send) -> Vec<T> {
    let mut out = vec![T::of(0.0); a.len()];
    let items: Vec<_> = out
        .chunks_mut(CHUNK)
        .zip(a.chunks(CHUNK).zip(b.chunks(CHUNK)))
        .collect();
    each_item(items, a.len(), |(out, (a, b))| {
        for (o, (&a, &b)) in out.iter_mut().zip(a.iter().zip(b)) {
            *o = f(a, b);
        }
    });
    out
}

/// Per-column sums over the rows of a row-major `rows x width` matrix:
/// each block of [`BLOCK_ROWS`] rows summed (in parallel when large), the
/// blocks' sums added in block order.
pub(super) fn column_sums<T: Float>(m: &[T], width: usize) -> Vec<T> {
    let mut partials = vec![T::of(0.0); m.len().div_ceil(BLOCK_ROWS * width.max(1)) * width];
    if width == 0 {
        return partials;
    }
    let items: Vec<_> = m
        .chunks(BLOCK_ROWS * width)
        .zip(partials.chunks_mut(width))
        .collect();
    each_item(items, m.len(), |(block, sums)| {
        for row in block.chunks(width) {
            sums.iter_mut().zip(row).for_each(|(s, &v)| *s = *s + v);
        }
    });
    add_blocks(&partials, width)
}

/// The element-wise sum of the `width`-long parts of `partials`, in order.
pub(super) fn add_blocks<T: Float>(partials: &[T], width: usize) -> Vec<T> {
    let mut total = vec![T::of(0.0); width];
    for part in partials.chunks(width.max(1)) {
        total.iter_mut().zip(part).for_each(|(t, &v)| *t = *t + v);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::Float;

    /// The vectorisable f32 `exp` and `tanh` against std's (libm's), over
    /// their whole useful range.
    #[test]
    fn f32_exp_and_tanh_stay_within_a_few_ulps_of_libms() {
        let (mut exp_rel, mut tanh_abs) = (0.0f64, 0.0f64);
        for i in 0..=400_000 {
            let x = -90.0 + i as f32 * 0.00045;
            let want = (x as f64).exp();
            // Below -87 it is 0 by design (e^-87 is 1.6e-38).
            if (-87.0..=88.0).contains(&x) {
                exp_rel = exp_rel.max(((Float::exp(x) as f64) - want).abs() / want);
            }
            tanh_abs = tanh_abs.max(((Float::tanh(x) as f64) - (x as f64).tanh()).abs());
        }
        assert!(exp_rel <= 2e-7, "exp {exp_rel:e}");
        assert!(tanh_abs <= 1.2e-7, "tanh {tanh_abs:e}");
        assert_eq!(Float::exp(-100.0f32), 0.0);
        assert!(Float::exp(f32::NAN).is_nan());
        assert_eq!(Float::tanh(0.0f32), 0.0);
        assert_eq!(Float::tanh(-30.0f32), -1.0);
    }
}
