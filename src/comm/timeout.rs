//! The timeout every group starts with: no collective waits forever unless
//! asked to.
//!
//! PyTorch's process groups default to 30 minutes (gloo; NCCL 10) and a
//! rank that stops arriving ends the others' waits with an error then.
//! candle-dp's groups do the same: [`GroupOptions::default`](super::GroupOptions)
//! takes [`DEFAULT_TIMEOUT`], or what the environment variable
//! [`TIMEOUT_VARIABLE`] says (for programs that expose no setting of
//! their own): a number of seconds, or `none` for no limit.
//!
//! ```
//! use std::time::Duration;
//! use candle_dp::comm::parse_timeout;
//!
//! assert_eq!(parse_timeout(None), Ok(Some(Duration::from_secs(1800))));
//! assert_eq!(parse_timeout(Some("90")), Ok(Some(Duration::from_secs(90))));
//! assert_eq!(parse_timeout(Some("none")), Ok(None));
//! assert!(parse_timeout(Some("soon")).is_err());
//! ```

use std::sync::Once;
use std::time::Duration;

/// A group's timeout when nothing else chooses one: 30 minutes, PyTorch's
/// default for its CPU (gloo) groups.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The environment variable that sets the default timeout of every group:
/// seconds (`600`, `2.5`), or `none` for no limit.
pub const TIMEOUT_VARIABLE: &str = "CANDLE_DP_TIMEOUT";

/// The timeout `value` of [`TIMEOUT_VARIABLE`] asks for ([`DEFAULT_TIMEOUT`]
/// when it is not set); `None` is no limit.
///
/// # Errors
///
/// A message naming the variable and the value, when it is neither a
/// positive number of seconds nor `none`.
pub fn parse_timeout(value: Option<&str>) -> Result<Option<Duration>, String> {
    let Some(value) = value.map(str::trim) else {
        return Ok(Some(DEFAULT_TIMEOUT));
    };
    if value.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    value
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .map(Some)
        .ok_or_else(|| {
            format!(
                "{TIMEOUT_VARIABLE}={value:?} is neither a positive number of seconds nor `none`"
            )
        })
}

/// The default timeout from the environment. An invalid value is reported
/// once on standard error and the default used.
pub(crate) fn timeout_from_env() -> Option<Duration> {
    let value = std::env::var(TIMEOUT_VARIABLE).ok();
    parse_timeout(value.as_deref()).unwrap_or_else(|message| {
        static WARNED: Once = Once::new();
        WARNED.call_once(|| {
            crate::report_lines::eprint_report(&format!(
                "candle-dp: {message}; using the default, {} s",
                DEFAULT_TIMEOUT.as_secs()
            ));
        });
        Some(DEFAULT_TIMEOUT)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_fractions_and_none_are_read_and_anything_else_refused() {
        assert_eq!(
            parse_timeout(Some(" 2.5 ")),
            Ok(Some(Duration::from_millis(2500)))
        );
        assert_eq!(parse_timeout(Some("NONE")), Ok(None));
        for bad in ["", "0", "-3", "nan", "inf", "1e400", "30m"] {
            let err = parse_timeout(Some(bad)).unwrap_err();
            assert!(err.contains("CANDLE_DP_TIMEOUT"), "{bad}: {err}");
        }
    }
}
