//! A row-major matrix transposed into a new row-major buffer, tile by
//! tile: the weight of a linear layer laid out as gemm reads it fastest.
//!
//! Why the linear layers need it: `x W^T` with `W` stored out x in (the
//! PyTorch layout) hands gemm a transposed weight. Its packing then reads
//! 64 rows of `W` at once, one element each, and where a row is a
//! multiple of 4 KiB long (a width of 1024 f32) every one of those reads
//! falls into the same L1 set. On the MLP's 1024 x 1024 layer at 128 rows
//! that product took 3.9-4.1 ms, against 1.5-2.1 ms for the same product
//! with the weight transposed beforehand (2-core Zen 4 VM,
//! docs/notes/findings.md, 2026-12-02); the transpose itself moves each
//! element once, 16 rows at a time.

use super::kernel::{each_item, Float};

/// Elements per side of a tile: a 64-byte cache line of f32, so that
/// every line read or written is used whole before the next tile.
const TILE: usize = 16;

/// `src` (`rows` x `cols`, row-major) transposed: `cols` x `rows`,
/// row-major. Bands of `TILE` output rows go to the rayon pool's threads
/// (see [`each_item`]); the bytes are a copy, so they do not depend on the
/// threads.
pub(super) fn transposed<T: Float>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    debug_assert_eq!(src.len(), rows * cols);
    let mut dst = vec![T::of(0.0); rows * cols];
    if rows == 0 || cols == 0 {
        return dst;
    }
    let bands: Vec<(usize, &mut [T])> = dst.chunks_mut(TILE * rows).enumerate().collect();
    each_item(bands, src.len(), |(band, out)| {
        transpose_band(src, rows, cols, band * TILE, out)
    });
    dst
}

/// Output rows `c0..` (source columns `c0..`, as many as `out` holds)
/// from every source row.
fn transpose_band<T: Float>(src: &[T], rows: usize, cols: usize, c0: usize, out: &mut [T]) {
    let width = out.len() / rows;
    for r0 in (0..rows).step_by(TILE) {
        let height = TILE.min(rows - r0);
        if width == TILE && height == TILE {
            transpose_tile(src, cols, r0, c0, out, rows);
        } else {
            for j in 0..width {
                for i in 0..height {
                    out[j * rows + r0 + i] = src[(r0 + i) * cols + c0 + j];
                }
            }
        }
    }
}

/// One whole tile, held in registers (or L1) between its reads of
/// `TILE` source rows and its writes of `TILE` output rows.
#[inline(always)]
fn transpose_tile<T: Float>(
    src: &[T],
    cols: usize,
    r0: usize,
    c0: usize,
    out: &mut [T],
    rows: usize,
) {
    let mut tile = [[T::of(0.0); TILE]; TILE];
    for (i, row) in tile.iter_mut().enumerate() {
        let at = (r0 + i) * cols + c0;
        row.copy_from_slice(&src[at..at + TILE]);
    }
    for j in 0..TILE {
        let mut column = [T::of(0.0); TILE];
        for (value, row) in column.iter_mut().zip(&tile) {
            *value = row[j];
        }
        out[j * rows + r0..][..TILE].copy_from_slice(&column);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(src: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                out[c * rows + r] = src[r * cols + c];
            }
        }
        out
    }

    #[test]
    fn every_shape_with_partial_tiles_is_the_element_by_element_transpose() {
        for (rows, cols) in [
            (0, 5),
            (5, 0),
            (1, 1),
            (1, 37),
            (37, 1),
            (16, 16),
            (17, 33),
            (64, 1024),
            (300, 131),
        ] {
            let src: Vec<f64> = (0..rows * cols).map(|i| i as f64 * 0.5 - 7.0).collect();
            assert_eq!(
                transposed(&src, rows, cols),
                naive(&src, rows, cols),
                "{rows} x {cols}"
            );
            let src32: Vec<f32> = src.iter().map(|&v| v as f32).collect();
            let want: Vec<f32> = naive(&src, rows, cols).iter().map(|&v| v as f32).collect();
            assert_eq!(transposed(&src32, rows, cols), want, "f32 {rows} x {cols}");
        }
    }
}
