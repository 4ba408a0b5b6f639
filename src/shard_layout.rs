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

    /// `full` padded with zero rows to `world * chunk_rows` rows, as one
    /// row of `shard_elems` per rank: shape `(world, shard_elems)`.
    pub(crate) fn padded_by_rank(&self, full: &Tensor) -> candle_core::Result<Tensor> {
        let flat = full.flatten_all()?;
        let pad = (self.world * self.chunk_rows - self.rows) * self.row_elems;
        let flat = match pad {
            0 => flat,
            n => Tensor::cat(&[flat, Tensor::zeros(n, full.dtype(), full.device())?], 0)?,
        };
        flat.reshape((self.world, self.shard_elems()))
    }

    /// Rank `rank`'s piece of `full`, padded: shape
    /// [`shard_dims`](Self::shard_dims). A copy of its own rows only (the
    /// whole tensor is not copied).
    pub(crate) fn shard_of(&self, full: &Tensor, rank: usize) -> candle_core::Result<Tensor> {
        let flat = full.flatten_all()?;
        let start = (rank * self.chunk_rows).min(self.rows) * self.row_elems;
        let real = self.real_rows(rank) * self.row_elems;
        let rows = flat.narrow(0, start, real)?;
        let piece = match self.shard_elems() - real {
            0 => rows.force_contiguous()?,
            pad => Tensor::cat(&[rows, Tensor::zeros(pad, full.dtype(), full.device())?], 0)?,
        };
        piece.reshape(self.shard_dims())
    }

    /// The whole parameter from every rank's piece, in rank order, each
    /// `shard_elems` long (the padding dropped).
    pub(crate) fn unshard(&self, pieces: &[Tensor]) -> candle_core::Result<Tensor> {
        let flat = Tensor::cat(pieces, 0)?.narrow(0, 0, self.rows * self.row_elems)?;
        flat.reshape(self.dims.as_slice())
    }
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
