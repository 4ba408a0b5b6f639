//! The header exchange that opens every collective: each rank sends every
//! other its signature (and a small payload), point to point, so that a
//! timeout names the ranks whose header never came.

use super::*;

impl Engine {
    /// Sends this rank's header (with what payload each destination needs)
    /// to every other rank and receives theirs: `headers[src]`, `None` for
    /// this rank.
    pub(super) fn exchange_headers(
        &mut self,
        sig: &Signature,
        kind: &Kind,
        ring: bool,
        parts: Option<&[usize]>,
    ) -> Result<Vec<Option<wire::Header>>, Stop> {
        let me = self.rank;
        let seq = self.seq();
        // What `dst` gets with the header.
        let payload_for = |dst: usize| -> Option<(&Buffer, Option<&[usize]>)> {
            match kind {
                Kind::Reduce { data, root, .. } if !ring && root.is_none_or(|r| r == dst) => {
                    data.as_ref().map(|d| (d, None))
                }
                Kind::Broadcast { root, data } if *root == me => data.as_ref().map(|d| (d, None)),
                Kind::AllGather { data } => data.as_ref().map(|d| (d, None)),
                Kind::Gather { root, data } if *root == dst => data.as_ref().map(|d| (d, None)),
                Kind::Scatter { root, parts } if *root == me => {
                    parts.get(dst).map(|(b, dims)| (b, Some(dims.as_slice())))
                }
                _ => None,
            }
        };
        // Destinations that get the same payload share one message.
        let same_for_all = !matches!(kind, Kind::Scatter { .. } | Kind::Gather { .. })
            && !matches!(kind, Kind::Reduce { root: Some(_), .. });
        let messages: Vec<(usize, Vec<u8>)> = if same_for_all {
            let message = self
                .others()
                .next()
                .map(|dst| wire::encode_header(seq, sig, payload_for(dst), parts))
                .unwrap_or_default();
            vec![(usize::MAX, message)]
        } else {
            self.others()
                .map(|dst| (dst, wire::encode_header(seq, sig, payload_for(dst), parts)))
                .collect()
        };
        let message_for = |dst: usize| -> &[u8] {
            messages
                .iter()
                .find(|(d, _)| *d == dst || *d == usize::MAX)
                .map_or(&[][..], |(_, m)| m.as_slice())
        };
        let mut headers: Vec<Option<wire::Header>> = (0..self.world_size).map(|_| None).collect();
        let mut missing: Vec<usize> = self.others().collect();
        mpi::request::scope(|scope| {
            let sends: Vec<_> = self
                .others()
                .map(|dst| {
                    self.data
                        .process_at_rank(dst as i32)
                        .immediate_send_with_tag(scope, message_for(dst), TAG_HEADER)
                })
                .map(sending)
                .collect();
            self.wait(sends, |engine| {
                engine.receive_headers(&mut missing, &mut headers)?;
                Ok(missing.is_empty())
            })
        })?;
        Ok(headers)
    }

    /// Receives the headers that have arrived from the ranks in `missing`.
    pub(super) fn receive_headers(
        &mut self,
        missing: &mut Vec<usize>,
        headers: &mut [Option<wire::Header>],
    ) -> Result<(), CommError> {
        let mut still = Vec::with_capacity(missing.len());
        for &src in missing.iter() {
            let probed = self
                .data
                .process_at_rank(src as i32)
                .immediate_matched_probe_with_tag(TAG_HEADER);
            let Some(matched) = probed else {
                still.push(src);
                continue;
            };
            let (message, _) = matched.matched_receive_vec::<u8>();
            let header =
                wire::decode_header(&message).map_err(|detail| self.unexpected(src, detail))?;
            if header.seq != self.seq() {
                return Err(self.unexpected(
                    src,
                    format!(
                        "it belongs to its collective #{}, this rank is in #{}",
                        header.seq,
                        self.seq()
                    ),
                ));
            }
            headers[src] = Some(header);
        }
        *missing = still;
        if let Some(current) = self.current.as_mut() {
            current.waiting_for.clone_from(missing);
        }
        Ok(())
    }
}
