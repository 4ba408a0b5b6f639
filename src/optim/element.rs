//! The element types an optimizer updates (f32, f64), their state buffers
//! (on the host, or on the parameter's device), reading and writing a
//! parameter's values, and where a step runs: a parameter on the CPU is
//! updated on the host, element by element in PyTorch's exact order; one
//! on another device (a GPU) with candle's tensor ops where it lives, its
//! state kept there too, so a step moves nothing to or from the host.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Shape, Tensor, Var};

/// A float type whose arithmetic the update kernels spell out.
pub(crate) trait Element:
    candle_core::WithDType
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
{
    /// `self * a + b`, rounded once (ATen's vectorised `fmadd`).
    fn fma(self, a: Self, b: Self) -> Self;
    fn sqrt(self) -> Self;
    fn is_nan(self) -> bool;
    /// A Python scalar as PyTorch applies it to a tensor of this dtype.
    fn of(x: f64) -> Self;
    /// The state buffer that holds this type, if `buffer` does.
    fn buffer_mut(buffer: &mut Buffer) -> Option<&mut Vec<Self>>;
    fn into_buffer(values: Vec<Self>) -> Buffer;
    /// The values of a CPU storage that holds this type.
    fn storage_mut(storage: &mut CpuStorage) -> Option<&mut Vec<Self>>;
}

/// `x = f(x, y)` for every `x` of `xs` and its `y` of `ys`: the
/// optimizers' element loops. Compiled for FMA as well, picked at run time:
/// there each [`Element::fma`] in `f` is one instruction instead of a call
/// to libm's software `fmaf` (3.3% of the language model's DDP step in
/// AdamW's moments), with the same bits either way (both round once).
#[multiversion::multiversion(targets("x86_64+fma"))]
pub(crate) fn update_each<T: Element, F: Fn(T, T) -> T>(xs: &mut [T], ys: &[T], f: F) {
    for (x, &y) in xs.iter_mut().zip(ys) {
        *x = f(*x, y);
    }
}

impl Element for f32 {
    #[inline]
    fn fma(self, a: Self, b: Self) -> Self {
        self.mul_add(a, b)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn of(x: f64) -> Self {
        x as f32
    }
    fn buffer_mut(buffer: &mut Buffer) -> Option<&mut Vec<Self>> {
        match buffer {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }
    fn into_buffer(values: Vec<Self>) -> Buffer {
        Buffer::F32(values)
    }
    fn storage_mut(storage: &mut CpuStorage) -> Option<&mut Vec<Self>> {
        match storage {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Element for f64 {
    #[inline]
    fn fma(self, a: Self, b: Self) -> Self {
        self.mul_add(a, b)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn of(x: f64) -> Self {
        x
    }
    fn buffer_mut(buffer: &mut Buffer) -> Option<&mut Vec<Self>> {
        match buffer {
            Buffer::F64(v) => Some(v),
            _ => None,
        }
    }
    fn into_buffer(values: Vec<Self>) -> Buffer {
        Buffer::F64(values)
    }
    fn storage_mut(storage: &mut CpuStorage) -> Option<&mut Vec<Self>> {
        match storage {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// One state slot of one parameter (a moment, a momentum buffer), on the
/// host, in the parameter's dtype.
#[derive(Debug, Clone)]
pub(crate) enum Buffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    /// On the parameter's device, in its shape and dtype (the device path).
    Tensor(Tensor),
}

impl Buffer {
    /// The buffer as a tensor of `shape` on the CPU.
    pub(crate) fn to_tensor(&self, shape: &Shape) -> candle_core::Result<Tensor> {
        match self {
            Buffer::F32(v) => Tensor::from_slice(v, shape, &Device::Cpu),
            Buffer::F64(v) => Tensor::from_slice(v, shape, &Device::Cpu),
            Buffer::Tensor(t) => t.reshape(shape)?.to_device(&Device::Cpu),
        }
    }

    /// The buffer as a tensor like `var` (its shape, dtype and device), for
    /// the device path: a host buffer (loaded from a checkpoint) moves to
    /// the device once.
    pub(crate) fn on_device_of(&self, var: &Var) -> candle_core::Result<Tensor> {
        match self {
            Buffer::Tensor(t) => Ok(t.clone()),
            host => host
                .to_tensor(var.shape())?
                .to_dtype(var.dtype())?
                .to_device(var.device()),
        }
    }

    /// A buffer from `tensor`, converted to `dtype`.
    pub(crate) fn from_tensor(tensor: &Tensor, dtype: DType) -> candle_core::Result<Buffer> {
        let flat = tensor.flatten_all()?.to_dtype(dtype)?;
        Ok(match dtype {
            DType::F64 => Buffer::F64(flat.to_vec1()?),
            _ => Buffer::F32(flat.to_dtype(DType::F32)?.to_vec1()?),
        })
    }
}

/// The values of `tensor` as a flat host vector.
pub(crate) fn host_values<T: Element>(tensor: &Tensor) -> candle_core::Result<Vec<T>> {
    tensor.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>()
}

/// Sets `var` (on its device, in its shape) to `values`.
pub(crate) fn write_back<T: Element>(var: &Var, values: Vec<T>) -> candle_core::Result<()> {
    let tensor = Tensor::from_vec(values, var.shape(), &Device::Cpu)?.to_device(var.device())?;
    var.set(&tensor)
}

/// The error for a parameter whose dtype the optimizers do not update.
pub(crate) fn unsupported_dtype(name: &str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "parameter `{name}` is {dtype:?}: candle_dp's optimizers update f32 and f64 parameters (keep an f32 master copy for lower precisions)"
    ))
}

/// The state buffer `slot` of a parameter of type `T`, which `state`
/// loaded or an earlier step made in that type.
pub(crate) fn typed<'a, T: Element>(
    buffer: &'a mut Buffer,
    name: &str,
    slot: &str,
) -> candle_core::Result<&'a mut Vec<T>> {
    // Kept on a device by an earlier step there: back to the host once.
    if let Buffer::Tensor(t) = buffer {
        *buffer = T::into_buffer(host_values(t)?);
    }
    T::buffer_mut(buffer).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "the `{slot}` state of parameter `{name}` is not {:?} as the parameter is",
            T::DTYPE
        ))
    })
}

/// The gradients of `params` in `grads`, by parameter index, once every
/// one of them is known to fit (an f32 or f64 parameter, a gradient of its
/// shape): a step either updates every parameter or none.
pub(crate) fn checked_grads(
    params: &[(String, Var)],
    grads: &GradStore,
) -> candle_core::Result<Vec<(usize, Tensor)>> {
    let mut todo = Vec::new();
    for (i, (name, var)) in params.iter().enumerate() {
        let Some(grad) = grads.get(var.as_tensor()) else {
            continue;
        };
        if !matches!(var.dtype(), DType::F32 | DType::F64) {
            return Err(unsupported_dtype(name, var.dtype()));
        }
        if grad.dims() != var.dims() {
            return Err(candle_core::Error::Msg(format!(
                "the gradient of parameter `{name}` has shape {:?}, the parameter {:?}",
                grad.dims(),
                var.dims()
            )));
        }
        todo.push((i, grad.clone()));
    }
    Ok(todo)
}

/// An optimizer that updates each parameter on its own, in the
/// parameter's element type.
pub(crate) trait PerParameter {
    /// The parameters, named.
    fn params(&self) -> &[(String, Var)];
    /// Updates parameter `i` with `grad` (checked to fit), in type `T`, on
    /// the host.
    fn update<T: Element>(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<()>;
    /// Updates parameter `i` with `grad` (checked to fit) where it lives,
    /// with tensor ops: the same formulas, in PyTorch's order, each op
    /// rounded on its own (where the host path fuses a multiply-add), so
    /// the two agree to rounding, not bit for bit.
    fn update_on_device(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<()>;
}

/// One optimizer step: every parameter with a gradient in `grads`
/// updated, once all of them are known to fit (else none).
pub(crate) fn step_each<O: PerParameter>(
    optimizer: &mut O,
    grads: &GradStore,
) -> candle_core::Result<()> {
    for (i, grad) in checked_grads(optimizer.params(), grads)? {
        let var = &optimizer.params()[i].1;
        if steps_on_device(var) {
            optimizer.update_on_device(i, &grad)?;
            continue;
        }
        match var.dtype() {
            DType::F64 => optimizer.update::<f64>(i, &grad)?,
            _ => optimizer.update::<f32>(i, &grad)?,
        }
    }
    Ok(())
}

/// Whether `var` is stepped on its device: any device but the CPU (and,
/// in the crate's tests, the CPU too when asked, to compare the paths).
pub(crate) fn steps_on_device(var: &Var) -> bool {
    !matches!(var.device(), Device::Cpu) || device_path_forced()
}

#[cfg(test)]
thread_local! {
    static FORCE_DEVICE_PATH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn device_path_forced() -> bool {
    FORCE_DEVICE_PATH.with(|f| f.get())
}

#[cfg(not(test))]
fn device_path_forced() -> bool {
    false
}

/// Runs `f` with the device path taken on the CPU too, on this thread.
#[cfg(test)]
pub(crate) fn with_device_path<R>(f: impl FnOnce() -> R) -> R {
    FORCE_DEVICE_PATH.with(|flag| flag.set(true));
    let out = f();
    FORCE_DEVICE_PATH.with(|flag| flag.set(false));
    out
}

/// A state tensor of the device path, checked to fit `var` (a state
/// loaded for another shape or dtype is an error, as on the host).
pub(crate) fn device_state(
    buffer: &Buffer,
    var: &Var,
    name: &str,
    slot: &str,
) -> candle_core::Result<Tensor> {
    let t = buffer.on_device_of(var)?;
    if t.dims() != var.dims() || t.dtype() != var.dtype() {
        return Err(candle_core::Error::Msg(format!(
            "the `{slot}` state of parameter `{name}` is {:?} {:?}, the parameter {:?} {:?}",
            t.dtype(),
            t.dims(),
            var.dtype(),
            var.dims()
        )));
    }
    Ok(t)
}
