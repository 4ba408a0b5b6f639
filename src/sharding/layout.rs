//! How one parameter is split across ranks: FSDP2's `torch.chunk` pieces
//! along dim 0, padded so that every rank's piece has the same shape. FSDP
//! shards the parameters so; ZeRO the gradients and optimizer state.

#[cfg(test)]
use candle_core::Device;
use candle_core::Tensor;

/// The split of one parameter of shape `dims` across `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardLayout {
    /// The parameter's shape (empty: a 0-dim parameter).
    pub(crate) dims: Vec<usize>,
    /// Rows along dim 0 (1 for a 0-dim parameter).
    rows: usize,
    /// Elements per row.
    row_elems: usize,
    /// Rows per rank: `ceil(rows / world)` (`torch.chunk`'s size); the
    /// last ranks may hold fewer real rows, or none, and are padded.
    chunk_rows: usize,
    world: usize,
}

impl ShardLayout {
    pub(crate) fn new(dims: &[usize], world: usize) -> Self {
        let (rows, row_elems) = match dims.split_first() {
            None => (1, 1),
            Some((&rows, rest)) => (rows, rest.iter().product()),
        };
        ShardLayout {
            dims: dims.to_vec(),
            rows,
            row_elems,
            chunk_rows: rows.div_ceil(world.max(1)),
            world: world.max(1),
        }
    }

    /// Rows along dim 0 (1 for a 0-dim parameter).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The number of ranks.
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Elements in each rank's (padded) piece.
    pub(crate) fn shard_elems(&self) -> usize {
        self.chunk_rows * self.row_elems
    }

    /// The shape of each rank's (padded) piece: `chunk_rows` rows.
    pub(crate) fn shard_dims(&self) -> Vec<usize> {
        match self.dims.split_first() {
            None => vec![self.chunk_rows],
            Some((_, rest)) => [&[self.chunk_rows][..], rest].concat(),
        }
    }

    /// The real rows of rank `rank`'s piece (the rest is padding).
    pub(crate) fn real_rows(&self, rank: usize) -> usize {
        self.rows
            .saturating_sub(rank * self.chunk_rows)
            .min(self.chunk_rows)
    }

    /// Rank `rank`'s piece of `full`, padded: shape
    /// [`shard_dims`](Self::shard_dims). A copy of its own rows only (the
    /// whole tensor is not copied).
    pub(crate) fn shard_of(&self, full: &Tensor, rank: usize) -> candle_core::Result<Tensor> {
        let flat = full.flatten_all()?;
        let range = self.real_range(rank);
        let real = range.len();
        let rows = flat.narrow(0, range.start, real)?;
        let piece = match self.shard_elems() - real {
            0 => rows.force_contiguous()?,
            pad => Tensor::cat(&[rows, Tensor::zeros(pad, full.dtype(), full.device())?], 0)?,
        };
        piece.reshape(self.shard_dims())
    }

    /// Where rank `rank`'s real rows lie in the flattened parameter (the
    /// rest of its piece is padding).
    pub(crate) fn real_range(&self, rank: usize) -> std::ops::Range<usize> {
        let start = (rank * self.chunk_rows).min(self.rows) * self.row_elems;
        start..start + self.real_rows(rank) * self.row_elems
    }

    /// Writes the real rows of rank `rank`'s `piece` (flat, `shard_elems`
    /// long) into `whole` (the parameter, contiguous), in place: one copy
    /// of those rows, where a whole parameter rebuilt from its pieces and
    /// then set would copy it twice.
    pub(crate) fn write_rows(
        &self,
        whole: &candle_core::Var,
        piece: &Tensor,
        rank: usize,
    ) -> candle_core::Result<()> {
        let real = self.real_rows(rank);
        if real == 0 {
            return Ok(());
        }
        let Some((_, rest)) = self.dims.split_first() else {
            // A 0-dim parameter: rank 0's one element.
            return whole.set(&piece.narrow(0, 0, 1)?.reshape(())?);
        };
        let rows = piece
            .narrow(0, 0, real * self.row_elems)?
            .reshape([&[real][..], rest].concat())?
            .contiguous()?;
        whole
            .as_tensor()
            .slice_set(&rows, 0, rank * self.chunk_rows)
    }

    /// The whole parameter from every rank's piece, in rank order, each
    /// `shard_elems` long (the padding dropped).
    pub(crate) fn unshard(&self, pieces: &[Tensor]) -> candle_core::Result<Tensor> {
        let flat = Tensor::cat(pieces, 0)?.narrow(0, 0, self.rows * self.row_elems)?;
        flat.reshape(self.dims.as_slice())
    }
}

/// The table a reduce-scatter of whole tensors into pieces takes: rank by
/// rank, each tensor's piece for that rank (`wholes[k]` flattened, split
/// by `layouts[k]`: its real rows, then zeros for the padding), then
/// `extra` (the same in every rank's section: presence flags, which every
/// rank thus receives reduced). One copy of the tensors, from contiguous
/// slices. Every rank's section has the same length, the table's
/// `1/world`.
pub(crate) fn pack_by_rank(
    wholes: &[Tensor],
    layouts: &[&ShardLayout],
    extra: Option<&Tensor>,
    world: usize,
) -> candle_core::Result<Tensor> {
    let mut parts = Vec::with_capacity(world * (2 * wholes.len() + 1));
    for rank in 0..world {
        for (whole, layout) in wholes.iter().zip(layouts) {
            let flat = whole.flatten_all()?;
            let real = layout.real_range(rank);
            let pad = layout.shard_elems() - real.len();
            if !real.is_empty() {
                parts.push(flat.narrow(0, real.start, real.len())?);
            }
            if pad > 0 {
                parts.push(Tensor::zeros(pad, whole.dtype(), whole.device())?);
            }
        }
        parts.extend(extra.cloned());
    }
    match parts.is_empty() {
        // Nothing but empty tensors: an empty table.
        true => match wholes.first() {
            Some(w) => Tensor::zeros(0, w.dtype(), w.device()),
            None => candle_core::bail!("a table of no tensors"),
        },
        false => Tensor::cat(&parts, 0),
    }
}

/// This rank's section of a [`pack_by_rank`] table, reduce-scattered: the
/// piece of each tensor `k` whose `present[k]` flag is positive (shaped as
/// a piece, in `dtypes[k]`, a copy of its own elements only: a view would
/// keep the whole section alive); `None` for the others.
pub(crate) fn unpack_section(
    section: &Tensor,
    layouts: &[&ShardLayout],
    present: &[f64],
    dtypes: &[candle_core::DType],
) -> candle_core::Result<Vec<Option<Tensor>>> {
    let mut offset = 0;
    let mut pieces = Vec::with_capacity(layouts.len());
    for ((layout, &flag), &dtype) in layouts.iter().zip(present).zip(dtypes) {
        let n = layout.shard_elems();
        pieces.push(match flag > 0.0 {
            true => Some(
                section
                    .narrow(0, offset, n)?
                    .reshape(layout.shard_dims())?
                    .to_dtype(dtype)?
                    .force_contiguous()?,
            ),
            false => None,
        });
        offset += n;
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_follow_torch_chunk_and_unshard_to_the_parameter() {
        // 5 rows on 4 ranks: torch.chunk gives 2, 2, 1 and nothing.
        let layout = ShardLayout::new(&[5, 3], 4);
        assert_eq!(layout.shard_dims(), [2, 3]);
        assert_eq!(
            (0..4).map(|r| layout.real_rows(r)).collect::<Vec<_>>(),
            [2, 2, 1, 0]
        );
        let full = Tensor::arange(0f32, 15., &Device::Cpu)
            .unwrap()
            .reshape((5, 3))
            .unwrap();
        let pieces: Vec<Tensor> = (0..4)
            .map(|r| layout.shard_of(&full, r).unwrap().flatten_all().unwrap())
            .collect();
        assert_eq!(
            pieces[2].to_vec1::<f32>().unwrap(),
            [12., 13., 14., 0., 0., 0.]
        );
        assert_eq!(pieces[3].to_vec1::<f32>().unwrap(), [0.; 6]);
        let back = layout.unshard(&pieces).unwrap();
        assert_eq!(
            back.to_vec2::<f32>().unwrap(),
            full.to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn a_table_by_rank_holds_each_ranks_pieces_then_the_extra() {
        // 3 rows of 2 on 2 ranks: rank 0 rows 0-1, rank 1 row 2 and padding.
        let a = Tensor::arange(0f32, 6., &Device::Cpu)
            .unwrap()
            .reshape((3, 2))
            .unwrap();
        let b = Tensor::new(9f32, &Device::Cpu).unwrap();
        let (la, lb) = (ShardLayout::new(&[3, 2], 2), ShardLayout::new(&[], 2));
        let flags = Tensor::new(&[7f32], &Device::Cpu).unwrap();
        let table = pack_by_rank(&[a, b], &[&la, &lb], Some(&flags), 2).unwrap();
        assert_eq!(
            table.to_vec1::<f32>().unwrap(),
            [0., 1., 2., 3., 9., 7., 4., 5., 0., 0., 0., 7.]
        );
    }

    #[test]
    fn a_zero_dim_parameter_lives_on_rank_zero() {
        let layout = ShardLayout::new(&[], 3);
        assert_eq!(layout.shard_dims(), [1]);
        let full = Tensor::new(2.5f32, &Device::Cpu).unwrap();
        let pieces: Vec<Tensor> = (0..3).map(|r| layout.shard_of(&full, r).unwrap()).collect();
        assert_eq!(pieces[0].to_vec1::<f32>().unwrap(), [2.5]);
        assert_eq!(pieces[1].to_vec1::<f32>().unwrap(), [0.]);
        let back = layout.unshard(&pieces).unwrap();
        assert_eq!(back.dims(), &[] as &[usize]);
        assert_eq!(back.to_scalar::<f32>().unwrap(), 2.5);
    }
}
