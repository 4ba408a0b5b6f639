//! A unit's gathered parameters freed after its forward and filled again
//! before its backward, while its graph (the activations) stays: FSDP2's
//! resharding, which frees a parameter's storage and gathers into it
//! again, instead of dropping the graph and recomputing the unit.
//!
//! The graph's nodes hold the gathered variables (their storage), so the
//! storage itself is emptied in place (an in-place op swaps in an empty
//! buffer) and later refilled with the values gathered again: every
//! node, and every view of a variable (a transposed weight), sees the
//! values again when the backward reads them. Between the two nothing may
//! read them: FSDP runs no other unit over them, and a unit whose output
//! shares a parameter's storage is not released (see [`shares_storage`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Shape, Tensor, Var};

/// Empties a variable's storage (CPU): its memory goes back to the
/// allocator; its shape stays.
struct Empty;

impl InplaceOp1 for Empty {
    fn name(&self) -> &'static str {
        "candle-dp-fsdp-release"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        // A copy of no elements: an empty buffer of the same dtype.
        let nothing = Layout::contiguous(Shape::from(0usize));
        *storage = storage.to_dtype(&nothing, storage.dtype())?;
        Ok(())
    }
}

/// Fills an emptied variable's storage with a copy of a tensor's values.
struct Refill;

impl InplaceOp2 for Refill {
    fn name(&self) -> &'static str {
        "candle-dp-fsdp-refill"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_layout: &Layout,
        src: &CpuStorage,
        src_layout: &Layout,
    ) -> candle_core::Result<()> {
        let (want, got) = (dst_layout.shape(), src_layout.shape());
        if want != got || dst_layout.contiguous_offsets() != Some((0, want.elem_count())) {
            candle_core::bail!(
                "FSDP refill: a variable of shape {want:?} (layout {dst_layout:?}) from values \
                 of shape {got:?}"
            );
        }
        // A same-dtype copy of exactly the source's elements, compact.
        *dst = src.to_dtype(src_layout, src.dtype())?;
        Ok(())
    }
}

/// Frees the storage of `vars` (the gathered parameters of a unit whose
/// forward has run); [`refill`] before anything reads them again.
pub(super) fn release<'a>(vars: impl IntoIterator<Item = &'a Var>) -> candle_core::Result<()> {
    vars.into_iter()
        .try_for_each(|v| v.as_tensor().inplace_op1(&Empty))
}

/// Fills each released variable of `vars` with the values of its
/// counterpart in `values` (gathered again, in the same order).
pub(super) fn refill<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    values: impl IntoIterator<Item = &'a Var>,
) -> candle_core::Result<()> {
    vars.into_iter()
        .zip(values)
        .try_for_each(|(v, values)| v.as_tensor().inplace_op2(values.as_tensor(), &Refill))
}

/// Whether `output` shares its storage with one of `vars` (a unit that
/// returns a view of a parameter): such a unit keeps its parameters, as
/// the next unit reads its output before the backward.
pub(super) fn shares_storage<'a>(output: &Tensor, vars: impl IntoIterator<Item = &'a Var>) -> bool {
    let (out, _) = output.storage_and_layout();
    let out: *const _ = &*out;
    vars.into_iter().any(|v| {
        let (storage, _) = v.as_tensor().storage_and_layout();
        std::ptr::eq(out, &*storage)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn a_released_variable_refilled_gives_its_graph_the_values_again() {
        let dev = Device::Cpu;
        let w = Var::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], (2, 2), &dev).unwrap();
        let x = Var::from_vec(vec![0.5f32, -1.0], (1, 2), &dev).unwrap();
        // The graph holds a view of the weight (its transpose).
        let y = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let expected = {
            let grads = y.sum_all().unwrap().backward().unwrap();
            grads.get(&x).unwrap().to_vec2::<f32>().unwrap()
        };
        let kept = Var::from_tensor(&w.as_tensor().copy().unwrap()).unwrap();
        release([&w]).unwrap();
        match &*w.as_tensor().storage_and_layout().0 {
            candle_core::Storage::Cpu(CpuStorage::F32(values)) => assert!(values.is_empty()),
            other => panic!("not an empty f32 storage: {:?}", other.dtype()),
        }
        refill([&w], [&kept]).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(grads.get(&x).unwrap().to_vec2::<f32>().unwrap(), expected);
        assert_eq!(
            w.as_tensor().to_vec2::<f32>().unwrap(),
            kept.as_tensor().to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn a_refill_of_another_shape_is_refused_naming_both() {
        let dev = Device::Cpu;
        let w = Var::zeros((2, 3), DType::F32, &dev).unwrap();
        let other = Var::zeros((3, 2), DType::F32, &dev).unwrap();
        release([&w]).unwrap();
        let e = refill([&w], [&other]).unwrap_err().to_string();
        assert!(e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    }

    #[test]
    fn an_output_that_is_a_view_of_a_parameter_shares_its_storage() {
        let dev = Device::Cpu;
        let w = Var::zeros((2, 3), DType::F32, &dev).unwrap();
        assert!(shares_storage(&w.as_tensor().t().unwrap(), [&w]));
        assert!(!shares_storage(&(w.as_tensor() + 1.0).unwrap(), [&w]));
    }
}
