//! What MPI ranks send each other, as bytes: the header that opens every
//! collective (with the small payloads that ride along), and the notices
//! through which a rank tells the others that it failed or left.
//!
//! A header message is `[u32 little-endian length][JSON header][payload]`:
//! JSON keeps the format readable and versionless (it is a few hundred bytes
//! at most, small next to the data), and the payload stays raw bytes.

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::comm::buffer::{match_dtype, Buffer, Element};
use crate::comm::protocol::{OpSig, Signature, TensorMeta};
use crate::comm::{Failure, FailureCause};

/// Element types that can travel as raw bytes: every dtype collectives
/// support (`half`'s `bytemuck` feature covers f16 and bf16).
pub(crate) trait Wire: Element + bytemuck::Pod {}

impl<T: Element + bytemuck::Pod> Wire for T {}

/// The bytes of a buffer's elements, in memory order.
pub(crate) fn bytes_of(buffer: &Buffer) -> &[u8] {
    match buffer {
        Buffer::U8(v) => v,
        Buffer::U32(v) => bytemuck::cast_slice(v),
        Buffer::I16(v) => bytemuck::cast_slice(v),
        Buffer::I32(v) => bytemuck::cast_slice(v),
        Buffer::I64(v) => bytemuck::cast_slice(v),
        Buffer::BF16(v) => bytemuck::cast_slice(v),
        Buffer::F16(v) => bytemuck::cast_slice(v),
        Buffer::F32(v) => bytemuck::cast_slice(v),
        Buffer::F64(v) => bytemuck::cast_slice(v),
    }
}

/// The buffer of `dtype` whose elements are `bytes`, or why there is none.
pub(crate) fn buffer_from_bytes(dtype: DType, bytes: &[u8]) -> Result<Buffer, String> {
    fn typed<T: Wire>(bytes: &[u8]) -> Result<Buffer, String> {
        let size = std::mem::size_of::<T>();
        if !bytes.len().is_multiple_of(size) {
            return Err(format!(
                "{} bytes are not a whole number of {} elements",
                bytes.len(),
                T::DTYPE.as_str()
            ));
        }
        // Copies: the payload follows the header at an arbitrary offset,
        // so it is not aligned for `T`.
        Ok(T::into_buffer(bytemuck::pod_collect_to_vec(bytes)))
    }
    match_dtype!(dtype, T => typed::<T>(bytes), _ => Err(format!("unsupported dtype {}", dtype.as_str())))
}

/// A dtype and shape, as sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WireMeta {
    pub(crate) dtype: String,
    pub(crate) dims: Vec<usize>,
}

impl WireMeta {
    pub(crate) fn new(dtype: DType, dims: &[usize]) -> WireMeta {
        WireMeta {
            dtype: dtype.as_str().to_string(),
            dims: dims.to_vec(),
        }
    }

    fn dtype(&self) -> Result<DType, String> {
        self.dtype
            .parse()
            .map_err(|_| format!("unknown dtype {:?}", self.dtype))
    }

    fn tensor_meta(&self) -> Result<TensorMeta, String> {
        Ok(TensorMeta {
            dtype: self.dtype()?,
            dims: self.dims.clone(),
        })
    }
}

/// The JSON part of a header message.
#[derive(Debug, Serialize, Deserialize)]
struct WireHeader {
    /// The sender's collective count, to catch ranks out of step.
    seq: u64,
    op: OpSig,
    meta: Option<WireMeta>,
    invalid: Option<String>,
    /// Describes the payload that follows the JSON, if any.
    payload: Option<WireMeta>,
    /// The lengths of the tensors a ring reduction reads in place, if it
    /// does (see `Kind::ReduceParts`).
    #[serde(default)]
    parts: Option<Vec<usize>>,
}

/// A decoded header message.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) seq: u64,
    pub(crate) sig: Signature,
    /// The payload with its shape.
    pub(crate) payload: Option<(Buffer, Vec<usize>)>,
    /// The lengths of the tensors the sender's ring reduction reads in
    /// place, if it does.
    pub(crate) parts: Option<Vec<usize>>,
}

/// Encodes a header message: `sig` for collective `seq`, with `payload`
/// and its shape (`None`: flat), and the lengths of the tensors a ring
/// reduction reads in place.
pub(crate) fn encode_header(
    seq: u64,
    sig: &Signature,
    payload: Option<(&Buffer, Option<&[usize]>)>,
    parts: Option<&[usize]>,
) -> Vec<u8> {
    let header = WireHeader {
        seq,
        op: sig.op,
        meta: sig.meta.as_ref().map(|m| WireMeta::new(m.dtype, &m.dims)),
        invalid: sig.invalid.clone(),
        payload: payload
            .map(|(buffer, dims)| WireMeta::new(buffer.dtype(), dims.unwrap_or(&[buffer.len()]))),
        parts: parts.map(<[usize]>::to_vec),
    };
    // Serializing plain data to a Vec cannot fail; an empty header would
    // be reported by the receiver as undecodable, never silently used.
    let json = serde_json::to_vec(&header).unwrap_or_default();
    let data = payload.map_or(&[][..], |(buffer, _)| bytes_of(buffer));
    let mut message = Vec::with_capacity(4 + json.len() + data.len());
    message.extend_from_slice(&(json.len() as u32).to_le_bytes());
    message.extend_from_slice(&json);
    message.extend_from_slice(data);
    message
}

/// Decodes a header message, or says why it cannot be.
pub(crate) fn decode_header(message: &[u8]) -> Result<Header, String> {
    let (len, rest) = message
        .split_first_chunk::<4>()
        .ok_or("a message shorter than its length prefix")?;
    let len = u32::from_le_bytes(*len) as usize;
    if rest.len() < len {
        return Err(format!("a header of {len} bytes in {} bytes", rest.len()));
    }
    let (json, data) = rest.split_at(len);
    let header: WireHeader =
        serde_json::from_slice(json).map_err(|e| format!("an undecodable header: {e}"))?;
    let meta = header
        .meta
        .as_ref()
        .map(WireMeta::tensor_meta)
        .transpose()?;
    let payload = match header.payload {
        None if data.is_empty() => None,
        None => {
            return Err(format!(
                "{} bytes of data without a description",
                data.len()
            ))
        }
        Some(wire) => {
            let meta = wire.tensor_meta()?;
            let buffer = buffer_from_bytes(meta.dtype, data)?;
            if buffer.len() != meta.dims.iter().product::<usize>() {
                return Err(format!(
                    "{} elements of data for shape {:?}",
                    buffer.len(),
                    meta.dims
                ));
            }
            Some((buffer, meta.dims))
        }
    };
    Ok(Header {
        seq: header.seq,
        sig: Signature {
            op: header.op,
            meta,
            invalid: header.invalid,
        },
        payload,
        parts: header.parts,
    })
}

/// The longest failure reason a notice carries; longer ones are cut.
const MAX_REASON_BYTES: usize = 1000;

/// The longest encoded notice: far below MPI's eager limit (4 KiB for
/// shared memory), so sending one does not wait for the receiver.
const MAX_NOTICE_BYTES: usize = 2048;

/// What one rank tells the others outside any collective.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Notice {
    /// The group failed (`rank` is the rank at fault, possibly not the
    /// sender).
    Failed { rank: usize, cause: WireCause },
    /// The sender finished after completing `seq` collectives.
    Left { seq: u64 },
}

/// [`FailureCause`] as sent (its `&'static str` cannot be deserialized).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum WireCause {
    Aborted(String),
    Panicked,
    Left,
    TimedOut { op: String, missing: Vec<usize> },
}

impl Notice {
    pub(crate) fn failed(failure: &Failure) -> Notice {
        let cause = match &failure.cause {
            FailureCause::Aborted(reason) => WireCause::Aborted(truncate(reason)),
            FailureCause::Panicked => WireCause::Panicked,
            FailureCause::Left => WireCause::Left,
            FailureCause::TimedOut { op, missing } => WireCause::TimedOut {
                op: op.to_string(),
                missing: missing.iter().copied().take(64).collect(),
            },
        };
        Notice::Failed {
            rank: failure.rank,
            cause,
        }
    }

    /// The notice as JSON, at most [`MAX_NOTICE_BYTES`] long: the reason is
    /// cut further when escaping made it longer.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut notice = self.clone();
        loop {
            let bytes = serde_json::to_vec(&notice).unwrap_or_default();
            if bytes.len() <= MAX_NOTICE_BYTES {
                return bytes;
            }
            match &mut notice {
                Notice::Failed {
                    cause: WireCause::Aborted(reason),
                    ..
                } if !reason.is_empty() => {
                    let keep = reason.len() / 2;
                    *reason = truncate_to(reason, keep);
                }
                Notice::Failed {
                    cause: WireCause::TimedOut { missing, .. },
                    ..
                } if !missing.is_empty() => missing.truncate(missing.len() / 2),
                // Nothing left to cut: a bare notice is a few dozen bytes.
                _ => return bytes,
            }
        }
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Notice, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("an undecodable notice: {e}"))
    }
}

impl WireCause {
    pub(crate) fn into_cause(self) -> FailureCause {
        match self {
            WireCause::Aborted(reason) => FailureCause::Aborted(reason),
            WireCause::Panicked => FailureCause::Panicked,
            WireCause::Left => FailureCause::Left,
            WireCause::TimedOut { op, missing } => FailureCause::TimedOut {
                op: OpSig::static_name(&op),
                missing,
            },
        }
    }
}

fn truncate(reason: &str) -> String {
    truncate_to(reason, MAX_REASON_BYTES)
}

/// `reason` cut to at most `max` bytes (at a character boundary), marked.
fn truncate_to(reason: &str, max: usize) -> String {
    if reason.len() <= max {
        return reason.to_string();
    }
    let mut end = max;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ReduceOp;

    #[test]
    fn header_round_trips_with_its_payload() {
        let sig = Signature {
            op: OpSig::Reduce {
                root: 1,
                op: ReduceOp::Max,
            },
            meta: Some(TensorMeta {
                dtype: DType::BF16,
                dims: vec![2, 3],
            }),
            invalid: Some("no".into()),
        };
        let payload = Buffer::BF16(vec![half::bf16::from_f32(1.5); 6]);
        let message = encode_header(7, &sig, Some((&payload, Some(&[2, 3]))), Some(&[4, 2]));
        let header = decode_header(&message).unwrap();
        assert_eq!(header.seq, 7);
        assert_eq!(header.sig.op, sig.op);
        assert_eq!(header.sig.meta, sig.meta);
        assert_eq!(header.sig.invalid.as_deref(), Some("no"));
        assert_eq!(header.payload, Some((payload, vec![2, 3])));
        assert_eq!(header.parts, Some(vec![4, 2]));
    }

    #[test]
    fn truncated_or_garbled_headers_are_errors() {
        let sig = Signature {
            op: OpSig::Barrier,
            meta: None,
            invalid: None,
        };
        let message = encode_header(1, &sig, Some((&Buffer::F32(vec![1.0; 4]), None)), None);
        assert!(decode_header(&message[..2]).is_err());
        assert!(decode_header(&message[..message.len() - 1]).is_err());
        let mut garbled = message.clone();
        garbled[5] = b'#';
        assert!(decode_header(&garbled).is_err());
    }

    #[test]
    fn notices_keep_the_rank_and_cut_long_reasons() {
        let failure = Failure {
            rank: 3,
            cause: FailureCause::Aborted("é".repeat(2000)),
        };
        let notice = Notice::decode(&Notice::failed(&failure).encode()).unwrap();
        let Notice::Failed { rank, cause } = notice else {
            panic!("not a failure notice: {notice:?}");
        };
        assert_eq!(rank, 3);
        let FailureCause::Aborted(reason) = cause.into_cause() else {
            panic!("not an abort");
        };
        assert!(reason.len() <= MAX_REASON_BYTES + '…'.len_utf8());
        // Control characters grow sixfold when escaped: still one small notice.
        let escaped = Failure {
            rank: 1,
            cause: FailureCause::Aborted("\u{1}".repeat(5000)),
        };
        assert!(Notice::failed(&escaped).encode().len() <= MAX_NOTICE_BYTES);
        let timed_out = Failure {
            rank: 0,
            cause: FailureCause::TimedOut {
                op: "all_reduce",
                missing: vec![1],
            },
        };
        let Notice::Failed { cause, .. } = Notice::failed(&timed_out) else {
            unreachable!()
        };
        assert_eq!(cause.into_cause(), timed_out.cause);
    }
}
