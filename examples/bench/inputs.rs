//! What several measurements share: the deterministic global batch of
//! 784-wide rows they train on, and a hash of the weights they end with
//! (equal hashes, equal bytes).

use anyhow::Result;
use candle_core::{Device, Tensor};

/// The global batch: deterministic inputs and labels.
pub fn global_batch(batch: usize) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..batch * 784)
        .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..batch as u32).map(|i| i % 10).collect();
    Ok((
        Tensor::from_vec(x, (batch, 784), &Device::Cpu)?,
        Tensor::from_vec(y, batch, &Device::Cpu)?,
    ))
}

/// FNV-1a over every parameter's bits, in name order.
pub fn hash_weights(params: &[(String, candle_core::Var)]) -> Result<u64> {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for (_, var) in params {
        for v in var.as_tensor().flatten_all()?.to_vec1::<f32>()? {
            for byte in v.to_bits().to_le_bytes() {
                hash = (hash ^ byte as u64).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    Ok(hash)
}
