//! What candle-dp's examples, benchmark and tests share beyond the library:
//! small real data sets, the language model and its data, and the numeric
//! flag parsers. Not part of candle-dp (its training machinery lives in the
//! library: `candle_dp::fabric`); a dev-dependency of the package.

pub mod datasets;
pub mod digits;
pub mod elastic;
pub mod flags;
pub mod gpt;
pub mod lm;
pub mod report;
pub mod text;
