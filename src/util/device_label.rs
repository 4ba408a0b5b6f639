//! How devices are named in error messages.

use candle_core::Device;

/// Label used in error messages: `cpu`, `cuda:1`, `metal:0`.
///
/// ```
/// assert_eq!(candle_dp::device_label(&candle_core::Device::Cpu), "cpu");
/// ```
pub fn device_label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}
