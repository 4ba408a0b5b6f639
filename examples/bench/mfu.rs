//! How far a row is from what the CPU can do: the FLOPs of a step by the
//! model's formula, per second, and their fraction of the CPU's f32 peak
//! (model FLOPs utilisation, MFU, as PaLM and nanoGPT count it: the
//! model's arithmetic, not what the kernels happen to run, so a
//! recomputation makes MFU lower, never higher).
//!
//! The peak is `cores x clock x FLOPs per cycle per core`, the last from
//! the widest vector instructions found at run time: two FMA pipes of
//! that width (AVX-512: 16 f32 lanes, AVX2 with FMA: 8; a fused
//! multiply-add counts as two FLOPs), as on the AMD Zen and Intel server
//! cores since Skylake; AMD's Zen 4 (family 25) runs AVX-512 on 256-bit
//! pipes, so it counts 8 lanes there. AMX (bf16 and int8 tiles) is named where present
//! but adds nothing to an f32 peak. The clock is the highest the kernel
//! reports (`cpuinfo_max_freq`, else `/proc/cpuinfo`'s MHz). Where the
//! kernel knows the boost clock the peak is an upper bound; in a VM that
//! shows only the nominal clock (2.6 GHz on the Zen 4 VM of 2026-12-02)
//! the cores may run faster. So beside it the bench measures what an FMA
//! loop reaches on every core at once ([`fma_peak`](crate::fma_peak)),
//! where that loop's 8 lanes are the width the peak counts.

use candle_dp_examples::gpt::GptConfig;

use crate::fma_peak;
use crate::plan::{cores, Model};

/// The CPU's f32 peak as this module counts it.
#[derive(Debug, Clone)]
pub struct Peak {
    pub cores: usize,
    pub ghz: f64,
    /// The widest vector instructions found ("AVX2+FMA", ...).
    pub isa: String,
    pub flops_per_cycle: f64,
    /// What an FMA loop reached on every core at once (GFLOP/s), where
    /// the peak counts 8 lanes (AVX2, Zen 4's AVX-512): the clock the
    /// cores ran at rather than the one reported.
    pub measured_gflops: Option<f64>,
}

impl Peak {
    /// This machine's (the cores the benchmark uses).
    pub fn of_this_cpu() -> Peak {
        let (isa, lanes, fma) = vector_width();
        // Two pipes of `lanes` f32; a fused multiply-add is two FLOPs.
        let flops_per_cycle = 2.0 * lanes as f64 * if fma { 2.0 } else { 1.0 };
        let measured_gflops = (lanes == 8 && fma)
            .then(|| fma_peak::measured_gflops(cores()))
            .flatten();
        Peak {
            cores: cores(),
            ghz: clock_ghz().unwrap_or(0.0),
            isa,
            flops_per_cycle,
            measured_gflops,
        }
    }

    /// GFLOP/s at the peak; 0 where no clock was found.
    pub fn gflops(&self) -> f64 {
        self.cores as f64 * self.ghz * self.flops_per_cycle
    }

    /// The line a report prints under its table.
    pub fn describe(&self) -> String {
        let measured = match self.measured_gflops {
            Some(m) if self.gflops() > 0.0 => format!(
                ". An FMA loop on every core at once reached {m:.1} GFLOP/s, {:.2}x that peak: \
                 against it each MFU is that much lower",
                m / self.gflops()
            ),
            _ => String::new(),
        };
        format!(
            "MFU: the model's FLOPs per step (the MLP's matrix products, forward and backward; \
             the language model's 6 x parameters x tokens plus attention's 12 x layers x width x \
             context per token) per second, over this CPU's f32 peak: {} cores x {:.2} GHz x \
             {:.0} FLOP/cycle ({}) = {:.1} GFLOP/s{measured}",
            self.cores,
            self.ghz,
            self.flops_per_cycle,
            self.isa,
            self.gflops()
        )
    }

    /// The two cells of a rate: GFLOP/s and its share of the peak.
    pub fn cells(&self, flops_per_s: Option<f64>) -> (String, String) {
        match flops_per_s {
            Some(f) => (
                format!("{:.1}", f / 1e9),
                if self.gflops() > 0.0 {
                    format!("{:.1}%", 100.0 * f / 1e9 / self.gflops())
                } else {
                    String::new()
                },
            ),
            None => (String::new(), String::new()),
        }
    }
}

/// FLOPs of one training sample of a benchmark network: each matrix
/// product's `2 x in x out` forward, as much again for the weight's
/// gradient, and for the input's gradient but at the first layer (whose
/// input needs none). `None` for the conv net (not counted here).
pub fn net_flops_per_sample(model: Model) -> Option<f64> {
    let width = match model {
        Model::Mlp | Model::MlpCandleOps => 1024,
        Model::MlpWide => 4096,
        Model::Conv => return None,
    };
    let layers = [(784, width), (width, width), (width, 10)];
    let products: f64 = layers.iter().map(|&(i, o)| 2.0 * (i * o) as f64).sum();
    let first = 2.0 * (784 * width) as f64;
    Some(3.0 * products - first)
}

/// FLOPs of one token of the language model's training step (PaLM's
/// count): `6 x parameters`, plus attention's scores and weighted sum,
/// `12 x layers x width x context`.
pub fn lm_flops_per_token(gpt: &GptConfig) -> f64 {
    6.0 * gpt.parameters() as f64 + 12.0 * (gpt.layers * gpt.width * gpt.context) as f64
}

/// The widest f32 vector instructions this CPU runs: their name, lanes and
/// whether they fuse multiply and add.
fn vector_width() -> (String, usize, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let amx = if cpu_flag("amx_tile") {
            " (AMX: bf16/int8 only)"
        } else {
            ""
        };
        if is_x86_feature_detected!("avx512f") {
            // AMD's Zen 4 (family 25) runs a 512-bit operation as two
            // halves on 256-bit pipes: AVX2's peak, not twice it.
            if cpu_field("vendor_id").as_deref() == Some("AuthenticAMD")
                && cpu_field("cpu family").as_deref() == Some("25")
            {
                return (format!("AVX-512 on Zen 4's 256-bit pipes{amx}"), 8, true);
            }
            return (format!("AVX-512{amx}"), 16, true);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return (format!("AVX2+FMA{amx}"), 8, true);
        }
        if is_x86_feature_detected!("avx") {
            return ("AVX".into(), 8, false);
        }
        ("SSE".into(), 4, false)
    }
    #[cfg(target_arch = "aarch64")]
    {
        // NEON: 4 f32 lanes with fused multiply-add.
        ("NEON".into(), 4, true)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        ("scalar".into(), 1, false)
    }
}

/// Whether `/proc/cpuinfo` lists `flag`.
#[cfg(target_arch = "x86_64")]
fn cpu_flag(flag: &str) -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == flag))
    })
}

/// The first value of `/proc/cpuinfo`'s field `name`.
#[cfg(target_arch = "x86_64")]
fn cpu_field(name: &str) -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines().find_map(|l| {
        let (key, value) = l.split_once(':')?;
        (key.trim() == name).then(|| value.trim().to_string())
    })
}

/// The highest clock the kernel reports, in GHz.
fn clock_ghz() -> Option<f64> {
    let max_khz = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok());
    if let Some(khz) = max_khz {
        return Some(khz / 1e6);
    }
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .filter(|l| l.starts_with("cpu MHz"))
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        .reduce(f64::max)
        .map(|mhz| mhz / 1e3)
}
