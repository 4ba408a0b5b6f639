//! The examples' checks of their numeric flags, as clap value parsers: a
//! value that makes no sense (a NaN clip norm, a learning rate of 0, a
//! checkpoint every 0 steps) stops the program as the flags are parsed,
//! with clap's message naming the flag and this module's saying what is
//! wrong, e.g.
//!
//! ```text
//! error: invalid value 'nan' for '--clip-grad-norm <X>': must be a finite number, got NaN
//! ```
//!
//! instead of running with it (silently without clipping, or saving
//! nothing). Use them as `#[arg(long, value_parser = flags::positive_f64)]`,
//! or for a count `value_parser = flags::at_least_one::<usize>` (the type
//! the field holds: clap checks it only when the field is read).
//!
//! Example code, not part of candle-dp (`candle_dp_examples::flags`).

/// Any finite number: NaN and the infinities are refused.
pub fn finite_f64(value: &str) -> Result<f64, String> {
    let x: f64 = value
        .parse()
        .map_err(|_| format!("must be a number, got '{value}'"))?;
    if x.is_nan() {
        return Err("must be a finite number, got NaN".into());
    }
    if x.is_infinite() {
        // `inf` or `-inf`.
        return Err(format!("must be a finite number, got {x}"));
    }
    Ok(x)
}

/// A finite number greater than 0 (a learning rate).
pub fn positive_f64(value: &str) -> Result<f64, String> {
    let x = finite_f64(value)?;
    if x > 0.0 {
        Ok(x)
    } else {
        Err(format!("must be greater than 0, got {x}"))
    }
}

/// A finite number of 0 or more (a weight decay; a clip norm where 0
/// turns clipping off).
pub fn non_negative_f64(value: &str) -> Result<f64, String> {
    let x = finite_f64(value)?;
    if x >= 0.0 {
        Ok(x)
    } else {
        Err(format!("must be 0 or more, got {x}"))
    }
}

/// A finite number from 0 to 1, both included (a share, a probability).
pub fn fraction(value: &str) -> Result<f64, String> {
    let x = finite_f64(value)?;
    if (0.0..=1.0).contains(&x) {
        Ok(x)
    } else {
        Err(format!("must be between 0 and 1, got {x}"))
    }
}

/// A whole number of 1 or more (steps, epochs, a batch, ranks, a period
/// in steps), as `T` (the type of the field it fills).
pub fn at_least_one<T: TryFrom<u64>>(value: &str) -> Result<T, String> {
    let n: u64 = value
        .parse()
        .map_err(|_| format!("must be a whole number of 1 or more, got '{value}'"))?;
    if n == 0 {
        return Err("must be at least 1, got 0".into());
    }
    let too_large = format!("must be a smaller number, got {n}");
    T::try_from(n).map_err(|_| too_large)
}

/// A list of CUDA ordinals, one per rank, replica or stage: `0`, `0,1`,
/// `0,0` or `[1]`. A lone number is a GPU, not a count: `--gpus 0` is
/// GPU 0 (the `Devices` rule of `--devices`, where `2` counts, made
/// `--gpus 0` an empty list of GPUs).
pub fn gpu_ordinals(value: &str) -> Result<candle_dp::fabric::Devices, String> {
    let inner = value.trim().trim_start_matches('[').trim_end_matches(']');
    let ordinals = inner
        .split(',')
        .map(|id| id.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| format!("must be GPU ordinals like 0 or 0,1, got '{value}'"))?;
    Ok(candle_dp::fabric::Devices::Ids(ordinals))
}
