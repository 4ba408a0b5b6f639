//! An embedding lookup whose backward sums a token's rows on their own
//! before they meet the table's other gradients, as PyTorch's does.
//!
//! candle's `index_select` adds each looked-up row straight into the
//! table's running gradient. When the table is also used elsewhere (a
//! language model's head tied to its token embedding), the whole graph's
//! backward then adds a repeated token's rows one by one onto the head's
//! contribution, `((h + e1) + e2)`, while a backward run unit by unit
//! (FSDP, DDP overlapped over units) sums the embedding's rows first and
//! adds them to the head's, `h + (e1 + e2)`: the same terms, other bits.
//! Here the rows are always summed first, on every path, so every
//! strategy's tied gradient is the same bytes ([`crate::deterministic`]
//! relies on it) and the order is PyTorch's (`embedding_dense_backward`
//! fills a fresh gradient that autograd then adds to the head's).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use super::indices::indices_below;

/// The rows of `table` (`vocab x width`) at `ids` (any shape, integer
/// dtype): a tensor of `ids`' shape with `width` appended.
///
/// Its backward gives the table a gradient of its own, the rows added in
/// the order of `ids` onto zeros, which autograd then adds to the table's
/// other gradients (see the module's note for why that order).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let table = Tensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((3, 2))?;
/// let ids = Tensor::new(&[[2u32, 0], [2, 1]], &Device::Cpu)?;
/// let rows = candle_dp::ops::embedding(&table, &ids)?;
/// assert_eq!(rows.dims(), &[2, 2, 2]);
/// assert_eq!(rows.to_vec3::<f32>()?[1], vec![vec![4.0, 5.0], vec![2.0, 3.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// A table that is not 2-D, ids that are not integers, or an id outside
/// the table (named with its position).
pub fn embedding(table: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (vocab, width) = table.dims2()?;
    if !matches!(ids.dtype(), DType::U8 | DType::U32 | DType::I64) {
        candle_core::bail!(
            "embedding: ids of dtype {:?}; they must be integers (u8, u32 or i64)",
            ids.dtype()
        );
    }
    let mut dims = ids.dims().to_vec();
    dims.push(width);
    let flat = ids.flatten_all()?.contiguous()?;
    // Checked here, on every device: candle's lookup reads an id of its
    // type's largest value (u8's 255 among them) as "no row" and gives
    // zeros and no gradient, and CUDA's kernel asserts on the others.
    if let Err((i, id)) = indices_below(&flat, vocab)? {
        candle_core::bail!(
            "embedding: id {id} at position {i} is not one of the table's {vocab} rows"
        );
    }
    // u8 ids as u32: candle's lookup skips u8's 255 even inside the table.
    let flat = match flat.dtype() {
        DType::U8 => flat.to_dtype(DType::U32)?,
        _ => flat,
    };
    let rows = if table.device().is_cpu() {
        table.apply_op2(&flat, Embedding)?
    } else {
        // The same backward order without a kernel of our own: the copy's
        // gradient collects the rows, then is added to the table's. It
        // costs one copy of the table per forward.
        table.copy()?.index_select(&flat, 0)?
    };
    rows.reshape(dims)
}

struct Embedding;

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "candle-dp-embedding"
    }

    fn cpu_fwd(
        &self,
        table: &CpuStorage,
        table_layout: &Layout,
        ids: &CpuStorage,
        ids_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let rows = table.index_select(ids, table_layout, ids_layout, 0)?;
        let width = table_layout.dims().get(1).copied().unwrap_or(1);
        Ok((rows, Shape::from((ids_layout.shape().elem_count(), width))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = table
            .zeros_like()?
            .index_add(ids, &grad_res.contiguous()?, 0)?;
        Ok((Some(grad), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Values chosen so that the order of the sum shows in the bits:
    /// `(h + e) + e` and `h + (e + e)` differ in f32.
    fn tied_grad(lookup: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>) -> Vec<f32> {
        let dev = Device::Cpu;
        let table = Var::from_vec(vec![1.0f32, 0.0], (2, 1), &dev).unwrap();
        let ids = Tensor::new(&[0u32, 0], &dev).unwrap();
        let scale = Tensor::new(&[[1.0f32], [1.0]], &dev).unwrap();
        // As in a language model, the lookup first and the tied head
        // after it: the rows' 3.0 each onto row 0, the head's 1e8 on all.
        let rows = lookup(table.as_tensor(), &ids).unwrap();
        let rows = rows
            .mul(&scale.affine(3.0, 0.0).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let head = table
            .as_tensor()
            .affine(1e8, 0.0)
            .unwrap()
            .sum_all()
            .unwrap();
        let loss = (rows + head).unwrap();
        let grads = loss.backward().unwrap();
        grads
            .get(&table)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn a_repeated_tokens_rows_are_summed_before_the_tables_other_gradient() {
        let ours = tied_grad(embedding);
        let expected = 1e8f32 + (3.0f32 + 3.0f32);
        assert_eq!(ours, vec![expected, 1e8]);
        // candle's own lookup adds the rows one by one onto 1e8: other bits,
        // so this test can tell the orders apart.
        let candles = tied_grad(|t, i| t.index_select(i, 0));
        assert_eq!(candles, vec![(1e8f32 + 3.0) + 3.0, 1e8]);
        assert_ne!(ours, candles);
    }

    #[test]
    fn the_lookup_is_index_selects_and_keeps_the_ids_shape() {
        let dev = Device::Cpu;
        let table = Tensor::arange(0f64, 12.0, &dev)
            .unwrap()
            .reshape((4, 3))
            .unwrap();
        let ids = Tensor::new(&[[3i64, 1, 1], [0, 2, 3]], &dev).unwrap();
        let ours = embedding(&table, &ids).unwrap();
        assert_eq!(ours.dims(), &[2, 3, 3]);
        let plain = table.index_select(&ids.flatten_all().unwrap(), 0).unwrap();
        assert_eq!(
            ours.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            plain.flatten_all().unwrap().to_vec1::<f64>().unwrap()
        );
    }

    /// candle's lookup reads u8's 255 as "no row": here it is row 255.
    #[test]
    fn a_u8_id_of_255_is_the_tables_last_row_with_its_gradient() {
        let dev = Device::Cpu;
        let table = Var::from_tensor(
            &Tensor::arange(0f32, 256.0, &dev)
                .unwrap()
                .reshape((256, 1))
                .unwrap(),
        )
        .unwrap();
        let ids = Tensor::new(&[255u8, 3], &dev).unwrap();
        let rows = embedding(table.as_tensor(), &ids).unwrap();
        assert_eq!(
            rows.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![255.0, 3.0]
        );
        let grads = rows.sum_all().unwrap().backward().unwrap();
        let grad = grads
            .get(&table)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!((grad[255], grad[3], grad[0]), (1.0, 1.0, 0.0));
    }

    #[test]
    fn ids_outside_the_table_or_not_integers_are_refused() {
        let dev = Device::Cpu;
        let table = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
        let err = embedding(&table, &Tensor::new(&[1u32, 4], &dev).unwrap()).unwrap_err();
        assert!(err.to_string().contains("id 4 at position 1"), "{err}");
        let err = embedding(&table, &Tensor::new(&[255u8], &dev).unwrap()).unwrap_err();
        assert!(err.to_string().contains("id 255"), "{err}");
        let err = embedding(&table, &Tensor::new(&[1.0f32], &dev).unwrap()).unwrap_err();
        assert!(err.to_string().contains("integers"), "{err}");
    }
}
