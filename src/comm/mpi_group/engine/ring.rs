//! Large reductions by the ring algorithm (reduce-scatter, then all-gather
//! or gather to the root), in the thread group's reduction order, and the
//! helpers that cut buffers into the ring's chunks.

use super::*;

impl Engine {
    /// A reduction by the ring algorithm: `Some(result)` on every rank
    /// (`root: None`) or on the root only. It works in `data` itself: the
    /// reduced chunks and the chunks received in the all-gather overwrite
    /// this rank's input, so the result costs no allocation or copy.
    pub(super) fn ring_reduce(
        &mut self,
        data: Buffer,
        op: ReduceOp,
        root: Option<usize>,
    ) -> Result<Option<Buffer>, Stop> {
        fn typed<T: Wire>(
            engine: &mut Engine,
            data: Buffer,
            op: ReduceOp,
            root: Option<usize>,
        ) -> Result<Option<Buffer>, Stop> {
            let mut x = T::vec_of(data)
                .map_err(|_| engine.unexpected(engine.rank, "a buffer of another type".into()))?;
            engine.reduce_scatter(&mut x, op)?;
            let whole = match root {
                None => {
                    // SAFETY: only MPI writes through it, whole received bytes.
                    engine.ring_all_gather(unsafe { as_receivable(&mut x) })?;
                    true
                }
                Some(root) => engine.gather_chunks(&mut x, root)?,
            };
            Ok(whole.then(|| T::into_buffer(x)))
        }
        match_dtype!(data.dtype(), T => typed::<T>(self, data, op, root), _ => {
            Err(self.unexpected(self.rank, format!("unsupported dtype {}", data.dtype().as_str())).into())
        })
    }

    /// A reduce-scatter by the ring: the reduce-scatter half of
    /// [`ring_reduce`](Engine::ring_reduce), so each element is reduced in
    /// the all-reduce's order, then every rank sends each other rank the
    /// part of its finished chunk that lies in that rank's piece (the
    /// pieces: `counts`, the same on every rank). About half the bytes of
    /// the all-reduce, and the same bytes as its slice.
    pub(super) fn ring_reduce_scatter(
        &mut self,
        data: Buffer,
        op: ReduceOp,
        counts: &[usize],
    ) -> Result<Buffer, Stop> {
        fn typed<T: Wire>(
            engine: &mut Engine,
            data: Buffer,
            op: ReduceOp,
            counts: &[usize],
        ) -> Result<Buffer, Stop> {
            let mut x = T::vec_of(data)
                .map_err(|_| engine.unexpected(engine.rank, "a buffer of another type".into()))?;
            if counts.len() != engine.world_size || counts.iter().sum::<usize>() != x.len() {
                let detail = format!("counts {counts:?} that do not split {} elements", x.len());
                return Err(engine.unexpected(engine.rank, detail).into());
            }
            engine.reduce_scatter(&mut x, op)?;
            Ok(T::into_buffer(engine.send_pieces(&x, counts)?))
        }
        match_dtype!(data.dtype(), T => typed::<T>(self, data, op, counts), _ => {
            Err(self.unexpected(self.rank, format!("unsupported dtype {}", data.dtype().as_str())).into())
        })
    }

    /// After the ring's reduce-scatter (chunk `rank` of `x` finished):
    /// sends every rank the part of this rank's chunk inside its piece,
    /// and returns this rank's piece, received from the ranks whose chunks
    /// it overlaps.
    fn send_pieces<T: Wire>(&mut self, x: &[T], counts: &[usize]) -> Result<Vec<T>, Stop> {
        let (r, w, len) = (self.rank, self.world_size, x.len());
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - n)
            })
            .collect();
        let piece = |q: usize| starts[q]..starts[q] + counts[q];
        let overlap = |a: Range<usize>, b: Range<usize>| a.start.max(b.start)..a.end.min(b.end);
        let mine = chunk_range(len, w, r);
        let my_piece = piece(r);
        let mut out = vec![T::zeroed(); counts[r]];
        // The ranks this one waits on: those it receives from or sends to.
        let mut peers = Vec::new();
        mpi::request::scope(|scope| {
            let mut requests = Vec::new();
            for q in self.others() {
                let part = overlap(mine.clone(), piece(q));
                if !part.is_empty() {
                    peers.push(q);
                    let bytes = bytemuck::cast_slice::<T, u8>(&x[part]);
                    let send = self.data.process_at_rank(q as i32);
                    requests.push(sending(
                        send.immediate_send_with_tag(scope, bytes, TAG_DATA),
                    ));
                }
            }
            // The chunks tile the buffer in order, so the parts of this
            // rank's piece come in order too.
            let mut rest = &mut out[..];
            for c in 0..w {
                let part = overlap(chunk_range(len, w, c), my_piece.clone());
                if part.is_empty() {
                    continue;
                }
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(part.len());
                rest = tail;
                if c == r {
                    head.copy_from_slice(&x[part]);
                    continue;
                }
                let bytes = bytemuck::cast_slice_mut::<T, u8>(head);
                let n = bytes.len();
                let from = self.data.process_at_rank(c as i32);
                let request = from.immediate_receive_into_with_tag(scope, bytes, TAG_DATA);
                requests.push(receiving(request, c, n));
                if !peers.contains(&c) {
                    peers.push(c);
                }
            }
            self.set_waiting_for(peers);
            self.wait(requests, |_| Ok(true))
        })?;
        Ok(out)
    }

    /// The ring on this rank's tensors where they lie (`Kind::ReduceParts`;
    /// every rank's parts have the lengths `lens`): the reduce-scatter
    /// sends its first chunk straight from the tensors and adds each
    /// received partial result to the tensors' elements into the result,
    /// then the all-gather runs as in [`ring_reduce`](Engine::ring_reduce).
    /// Same messages' contents and reduction order as on the concatenation.
    pub(super) fn ring_reduce_parts(
        &mut self,
        input: &Input,
        dtype: DType,
        lens: &[usize],
        op: ReduceOp,
    ) -> Result<Option<Buffer>, Stop> {
        fn typed<T: Wire>(
            engine: &mut Engine,
            input: &Input,
            lens: &[usize],
            op: ReduceOp,
        ) -> Result<Option<Buffer>, Stop> {
            // A ring of one rank would leave the result unwritten; no path
            // takes the ring then (`protocol::takes_ring`), and this keeps
            // the `set_len` below from depending on it.
            if engine.world_size < 2 {
                let detail = "a ring of a single rank".into();
                return Err(engine.unexpected(engine.rank, detail).into());
            }
            // Every element is received before it is read, so the result
            // is not zero-filled first (see `message_bytes`).
            let len = lens.iter().sum();
            let mut x: Vec<T> = Vec::with_capacity(len);
            let result = &mut x.spare_capacity_mut()[..len];
            let scattered = read_parts::<T, _>(input, |parts| {
                engine.reduce_scatter_parts(parts, lens, result, op)
            });
            match scattered {
                Ok(done) => done?,
                Err(part) => {
                    let detail = format!("its part {part} holds no {} elements", T::DTYPE.as_str());
                    return Err(engine.unexpected(engine.rank, detail).into());
                }
            }
            engine.ring_all_gather(result)?;
            // SAFETY: the chunks tile the buffer; chunk `rank` was received
            // (its last step) and reduced, every other chunk received by
            // the all-gather, whose receives have completed.
            unsafe { x.set_len(len) };
            Ok(Some(T::into_buffer(x)))
        }
        match_dtype!(dtype, T => typed::<T>(self, input, lens, op), _ => {
            Err(self.unexpected(self.rank, format!("unsupported dtype {}", dtype.as_str())).into())
        })
    }

    /// [`reduce_scatter`](Engine::reduce_scatter) with this rank's data in
    /// `parts` (lengths `lens`, the same on every rank) instead of in `x`:
    /// leaves chunk `rank` of `x` reduced and finished. The first step's
    /// chunk travels as one message per part it overlaps, later steps'
    /// partial results as one.
    pub(super) fn reduce_scatter_parts<T: Wire>(
        &mut self,
        parts: &[&[T]],
        lens: &[usize],
        x: &mut [MaybeUninit<T>],
        op: ReduceOp,
    ) -> Result<(), Stop> {
        let (r, w) = (self.rank, self.world_size);
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let len = x.len();
        let chunk = |c: usize| chunk_range(len, w, c);
        for step in 0..w - 1 {
            let send_chunk = (r + 2 * w - 1 - step) % w;
            let recv_chunk = (r + 2 * w - 2 - step) % w;
            let cuts_in = cuts(lens, chunk(recv_chunk));
            {
                let mut chunks = split_chunks(x, w);
                let (partial, recv) = pair(&mut chunks, send_chunk, recv_chunk);
                let sends: Vec<&[MessageByte]> = if step == 0 {
                    cuts(lens, chunk(send_chunk))
                        .into_iter()
                        .map(|(part, local, _)| sent(&parts[part][local]))
                        .collect()
                } else {
                    // SAFETY: received in the step before, and reduced.
                    vec![sent(unsafe { assume_received_ref(partial) })]
                };
                // `prev` cuts its first chunk as this rank cuts the same chunk.
                let recv_at = chunk(recv_chunk).start;
                let receives: Vec<&mut [MessageByte]> = if step == 0 && cuts_in.is_empty() {
                    Vec::new()
                } else if step == 0 {
                    split_at_cuts(recv, cuts_in.iter().map(|(_, _, at)| at.start - recv_at))
                        .into_iter()
                        .map(received)
                        .collect()
                } else {
                    vec![received(recv)]
                };
                self.step_many(&sends, next, receives, prev)?;
            }
            // The last step's chunk is this rank's: finished in the same pass.
            let last = step == w - 2;
            for (part, local, at) in cuts_in {
                // SAFETY: the step's receives, which covered the chunk, completed.
                let partial = unsafe { assume_received(&mut x[at]) };
                if last {
                    combine_into_finished(op, partial, &parts[part][local], w);
                } else {
                    combine_into(op, partial, &parts[part][local]);
                }
            }
        }
        Ok(())
    }

    /// The ring's reduce-scatter, in place: leaves chunk `rank` of `x`
    /// reduced over every rank as `((x_{c+1} ⊕ x_{c+2}) ⊕ …) ⊕ x_c` (the
    /// thread group's order), finished (`Avg` divided). The other chunks
    /// hold partial sums afterwards.
    pub(super) fn reduce_scatter<T: Wire>(
        &mut self,
        x: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Stop> {
        let (r, w) = (self.rank, self.world_size);
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let len = x.len();
        let chunk = |c: usize| chunk_range(len, w, c);
        // Kept from call to call: fresh memory would cost a page fault per
        // page on every call (about as much as the copy into it).
        let mut scratch = std::mem::take(&mut self.scratch);
        for step in 0..w - 1 {
            // Chunk c starts at rank c+1 and ends, fully reduced, at rank c;
            // the chunk sent is the one reduced in the step before.
            let send_chunk = (r + 2 * w - 1 - step) % w;
            let recv_chunk = (r + 2 * w - 2 - step) % w;
            let received = typed_scratch::<T>(&mut scratch, chunk(recv_chunk).len());
            let stepped = self.step(&x[chunk(send_chunk)], next, received, prev);
            if let Err(stop) = stepped {
                self.scratch = scratch;
                return Err(stop);
            }
            // The last step's chunk is this rank's: finished in the same pass.
            if step == w - 2 {
                combine_over_finished(op, received, &mut x[chunk(recv_chunk)], w);
            } else {
                combine_over(op, received, &mut x[chunk(recv_chunk)]);
            }
        }
        self.scratch = scratch;
        Ok(())
    }

    /// The ring's all-gather, in place: every rank's reduced chunk into
    /// `x`, whose chunk `rank` is this rank's (the only one that needs to
    /// be initialised).
    pub(super) fn ring_all_gather<T: Wire>(
        &mut self,
        x: &mut [MaybeUninit<T>],
    ) -> Result<(), Stop> {
        let (r, w) = (self.rank, self.world_size);
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let mut chunks = split_chunks(x, w);
        for step in 0..w - 1 {
            let send_chunk = (r + w - step) % w;
            let recv_chunk = (r + 2 * w - 1 - step) % w;
            let (send, recv) = pair(&mut chunks, send_chunk, recv_chunk);
            // SAFETY: this rank's chunk, or the one received in the step
            // before.
            let send = sent(unsafe { assume_received_ref(send) });
            self.step_many(&[send], next, vec![received(recv)], prev)?;
        }
        Ok(())
    }

    /// Every rank's reduced chunk to `root`, into its `x`; returns whether
    /// `x` now holds the whole result (on `root` only).
    pub(super) fn gather_chunks<T: Wire>(
        &mut self,
        x: &mut [T],
        root: usize,
    ) -> Result<bool, Stop> {
        let w = self.world_size;
        if self.rank != root {
            let mine = &x[chunk_range(x.len(), w, self.rank)];
            mpi::request::scope(|scope| {
                let send = self
                    .data
                    .process_at_rank(root as i32)
                    .immediate_send_with_tag(scope, bytemuck::cast_slice::<T, u8>(mine), TAG_DATA);
                self.set_waiting_for(vec![root]);
                self.wait(vec![sending(send)], |_| Ok(true))
            })?;
            return Ok(false);
        }
        let mut chunks = split_chunks(x, w);
        let others: Vec<usize> = self.others().collect();
        mpi::request::scope(|scope| {
            let receives: Vec<_> = chunks
                .iter_mut()
                .enumerate()
                .filter(|(src, _)| *src != root)
                .map(|(src, chunk)| {
                    let bytes = bytemuck::cast_slice_mut::<T, u8>(chunk);
                    let len = bytes.len();
                    let request = self
                        .data
                        .process_at_rank(src as i32)
                        .immediate_receive_into_with_tag(scope, bytes, TAG_DATA);
                    receiving(request, src, len)
                })
                .collect();
            self.set_waiting_for(others);
            self.wait(receives, |_| Ok(true))
        })?;
        Ok(true)
    }

    /// One ring step: sends `send` to `to` while receiving `recv` from
    /// `from`.
    pub(super) fn step<T: Wire>(
        &mut self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<(), Stop> {
        // SAFETY: only MPI writes through it, whole received bytes.
        let recv = received(unsafe { as_receivable(recv) });
        self.step_many(&[sent(send)], to, vec![recv], from)
    }

    /// One ring step in several messages: sends each of `sends` to `to`,
    /// in order, while receiving `from`'s messages, in order, into
    /// `receives` (MPI keeps the order of messages between two ranks).
    pub(super) fn step_many(
        &mut self,
        sends: &[&[MessageByte]],
        to: usize,
        receives: Vec<&mut [MessageByte]>,
        from: usize,
    ) -> Result<(), Stop> {
        self.set_waiting_for(vec![from]);
        mpi::request::scope(|scope| {
            let mut requests = Vec::with_capacity(sends.len() + receives.len());
            for &send in sends {
                requests.push(sending(
                    self.data
                        .process_at_rank(to as i32)
                        .immediate_send_with_tag(scope, send, TAG_DATA),
                ));
            }
            for recv in receives {
                let len = recv.len();
                let request = self
                    .data
                    .process_at_rank(from as i32)
                    .immediate_receive_into_with_tag(scope, recv, TAG_DATA);
                requests.push(receiving(request, from, len));
            }
            self.wait(requests, |_| Ok(true))
        })
    }
}

/// Where `range` of a concatenation of parts of lengths `lens` lies: for
/// each part it overlaps (empty overlaps left out), the part, the range
/// within the part, and the range within the concatenation.
pub(super) fn cuts(
    lens: &[usize],
    range: Range<usize>,
) -> Vec<(usize, Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (part, &n) in lens.iter().enumerate() {
        let at = range.start.max(start)..range.end.min(start + n);
        if !at.is_empty() {
            out.push((part, at.start - start..at.end - start, at));
        }
        start += n;
    }
    out
}

/// `values` cut at the offsets `starts` (ascending, the first 0) into
/// consecutive pieces; the last runs to the end.
pub(super) fn split_at_cuts<T>(
    values: &mut [T],
    starts: impl Iterator<Item = usize>,
) -> Vec<&mut [T]> {
    let mut pieces = Vec::new();
    let mut rest = values;
    let mut consumed = 0;
    for start in starts.skip(1) {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(start - consumed);
        pieces.push(head);
        rest = tail;
        consumed = start;
    }
    pieces.push(rest);
    pieces
}

/// `values` cut into the ring's `chunks` contiguous chunks.
pub(super) fn split_chunks<T>(values: &mut [T], chunks: usize) -> Vec<&mut [T]> {
    let len = values.len();
    let mut rest = values;
    let mut out = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let (head, tail) =
            std::mem::take(&mut rest).split_at_mut(chunk_range(len, chunks, c).len());
        out.push(head);
        rest = tail;
    }
    out
}

/// Chunk `a` to read and chunk `b` to write, `a != b`.
pub(super) fn pair<'s, T>(
    chunks: &'s mut [&mut [T]],
    a: usize,
    b: usize,
) -> (&'s [T], &'s mut [T]) {
    if a < b {
        let (low, high) = chunks.split_at_mut(b);
        (&*low[a], &mut *high[0])
    } else {
        let (low, high) = chunks.split_at_mut(a);
        (&*high[0], &mut *low[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_buffer_in_ring_order() {
        let mut values: Vec<u32> = (0..7).collect();
        let chunks = split_chunks(&mut values, 3);
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        assert_eq!(lens, vec![3, 2, 2]);
        assert_eq!(chunks[2], &[5, 6]);
    }

    #[test]
    fn cuts_follow_the_parts_a_range_overlaps_and_skip_empty_ones() {
        // Parts [0, 3), [3, 3) (empty), [3, 7), [7, 9).
        let lens = [3, 0, 4, 2];
        assert_eq!(
            cuts(&lens, 2..8),
            vec![(0, 2..3, 2..3), (2, 0..4, 3..7), (3, 0..1, 7..8)]
        );
        assert_eq!(cuts(&lens, 4..6), vec![(2, 1..3, 4..6)]);
        assert!(cuts(&lens, 5..5).is_empty());
    }

    #[test]
    fn split_at_cuts_gives_consecutive_pieces_covering_the_slice() {
        let mut values: Vec<u32> = (0..6).collect();
        let pieces = split_at_cuts(&mut values, [0, 1, 4].into_iter());
        let pieces: Vec<Vec<u32>> = pieces.into_iter().map(|p| p.to_vec()).collect();
        assert_eq!(pieces, vec![vec![0], vec![1, 2, 3], vec![4, 5]]);
    }

    #[test]
    fn pair_gives_the_two_chunks_asked_for_in_either_order() {
        let mut values: Vec<u32> = (0..6).collect();
        let mut chunks = split_chunks(&mut values, 3);
        let (read, write) = pair(&mut chunks, 2, 0);
        assert_eq!(read, &[4, 5]);
        write.copy_from_slice(&[9, 9]);
        let (read, _) = pair(&mut chunks, 0, 1);
        assert_eq!(read, &[9, 9]);
    }
}
