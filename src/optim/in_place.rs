//! A parameter on the CPU updated where its values lie: the optimizers'
//! host path reads the gradient in its tensor and writes the parameter in
//! its own storage, instead of copying both out to vectors and the result
//! back in (four more passes over the parameter's bytes, the most of an
//! SGD step's time).
//!
//! Writing into a variable's storage is what candle's `Var::set` does too;
//! here it goes through an in-place custom op, which holds the parameter's
//! write lock and the gradient's read lock while the update runs.

use std::cell::RefCell;
use std::marker::PhantomData;

use candle_core::{CpuStorage, InplaceOp2, Layout, Storage, Tensor, Var};

use super::element::{host_values, write_back, Element};

/// Runs `update(p, g)` on `var`'s values `p`, in place, and `grad`'s values
/// `g` (converted to `T` first if they are not). Where the values cannot be
/// reached in place (a variable not on the CPU, one without elements, a
/// gradient that shares its storage), on copies, then written back: the
/// same result. `update` cannot fail, so a step that fails does so before
/// it, and the parameter is untouched.
pub(crate) fn update_in_place<T: Element>(
    var: &Var,
    grad: &Tensor,
    update: impl FnOnce(&mut [T], &[T]),
) -> candle_core::Result<()> {
    let grad = grad.to_dtype(T::DTYPE)?;
    let grad = if grad.is_contiguous() {
        grad
    } else {
        grad.contiguous()?
    };
    // candle refuses an in-place write into a shape such as (3, 0), whose
    // zero strides look like repeated elements; nothing to update anyway.
    let in_place = var.device().is_cpu() && var.elem_count() > 0 && var.is_contiguous();
    if in_place && !same_storage(var.as_tensor(), &grad) {
        let op = Update {
            update: RefCell::new(Some(update)),
            element: PhantomData,
        };
        // candle takes the two storages' locks in its fixed order.
        return var.as_tensor().inplace_op2(&grad, &op);
    }
    let mut p: Vec<T> = host_values(var.as_tensor())?;
    let g: Vec<T> = host_values(&grad)?;
    update(&mut p, &g);
    write_back(var, p)
}

/// Whether `a` and `b` are views of one storage. Each lock is let go
/// before the next is taken.
fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    let key = |t: &Tensor| {
        let (storage, _) = t.storage_and_layout();
        std::ptr::from_ref::<Storage>(&storage) as usize
    };
    key(a) == key(b)
}

/// The in-place op: the update, run once on the parameter's values and
/// the gradient's.
struct Update<T, F> {
    update: RefCell<Option<F>>,
    element: PhantomData<T>,
}

impl<T: Element, F: FnOnce(&mut [T], &[T])> InplaceOp2 for Update<T, F> {
    fn name(&self) -> &'static str {
        "candle-dp-optimizer-update"
    }

    fn cpu_fwd(
        &self,
        param: &mut CpuStorage,
        param_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> candle_core::Result<()> {
        let (Some(p), Some(g)) = (
            param_layout.contiguous_offsets(),
            grad_layout.contiguous_offsets(),
        ) else {
            candle_core::bail!(
                "{}: a parameter or gradient laid out with gaps",
                self.name()
            )
        };
        let grad = T::cpu_storage_as_slice(grad)?.get(g.0..g.1);
        let param = T::storage_mut(param).and_then(|v| v.get_mut(p.0..p.1));
        let (Some(param), Some(grad)) = (param, grad) else {
            candle_core::bail!(
                "{}: a parameter or gradient not of {:?}",
                self.name(),
                T::DTYPE
            )
        };
        if param.len() != grad.len() {
            candle_core::bail!(
                "{}: a parameter of {} elements, its gradient {}",
                self.name(),
                param.len(),
                grad.len()
            )
        }
        let Some(update) = self.update.borrow_mut().take() else {
            candle_core::bail!("{}: run twice", self.name())
        };
        update(param, grad);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use candle_core::{DType, Device, Tensor, Var};

    use super::update_in_place;

    /// `p - g`, element by element, through `update_in_place`.
    fn step(var: &Var, grad: &Tensor) -> candle_core::Result<Vec<f32>> {
        update_in_place::<f32>(var, grad, |p, g| {
            p.iter_mut().zip(g).for_each(|(p, &g)| *p -= g);
        })?;
        var.as_tensor().flatten_all()?.to_vec1()
    }

    #[test]
    fn a_parameter_updated_in_place_is_seen_by_its_views() {
        let var = Var::from_vec(vec![1f32, 2., 3., 4.], (2, 2), &Device::Cpu).unwrap();
        // A view taken before the step sees the new values: one storage.
        let view = var.as_tensor().clone();
        let grad = Tensor::new(&[[0.5f32, 1.], [1.5, 2.]], &Device::Cpu).unwrap();
        assert_eq!(step(&var, &grad).unwrap(), [0.5, 1., 1.5, 2.]);
        assert_eq!(
            view.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [0.5, 1., 1.5, 2.]
        );
    }

    #[test]
    fn a_transposed_or_f64_gradient_gives_the_values_of_a_plain_one() {
        let dev = Device::Cpu;
        let values = vec![1f32, 2., 3., 4., 5., 6.];
        let plain = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &dev).unwrap();
        let transposed = Tensor::new(&[[1f32, 4.], [2., 5.], [3., 6.]], &dev)
            .unwrap()
            .t()
            .unwrap();
        assert!(!transposed.is_contiguous());
        let wide = plain.to_dtype(DType::F64).unwrap();
        let mut got = Vec::new();
        for grad in [&plain, &transposed, &wide] {
            let var = Var::from_vec(values.clone(), (2, 3), &dev).unwrap();
            got.push(step(&var, grad).unwrap());
        }
        assert_eq!(got[0], [0f32; 6]);
        assert_eq!(got[1], got[0]);
        assert_eq!(got[2], got[0]);
    }

    #[test]
    fn a_gradient_that_is_the_parameter_itself_is_read_from_a_copy() {
        // In place, the gradient's read lock and the parameter's write lock
        // would be one lock: a deadlock. Bounded by a deadline.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let var = Var::from_vec(vec![1f32, 2.], 2, &Device::Cpu).unwrap();
            let grad = var.as_tensor().clone();
            tx.send(step(&var, &grad).map_err(|e| e.to_string())).ok();
        });
        let got = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("no deadlock");
        assert_eq!(got.unwrap(), [0f32, 0.]);
    }

    #[test]
    fn a_parameter_without_elements_steps_as_any_other() {
        for shape in [vec![0], vec![3, 0], vec![2, 0, 5]] {
            let var = Var::zeros(shape.as_slice(), DType::F32, &Device::Cpu).unwrap();
            let grad = Tensor::zeros(shape.as_slice(), DType::F32, &Device::Cpu).unwrap();
            assert_eq!(step(&var, &grad).unwrap(), Vec::<f32>::new(), "{shape:?}");
        }
    }
}
