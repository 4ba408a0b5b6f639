//! [`DeviceMesh`]: the ranks of a group laid out in named dimensions, with
//! one sub-group per dimension through each rank, as PyTorch's
//! `init_device_mesh`.

use std::fmt;
use std::sync::Arc;

use super::split::{Color, SubGroup};
use super::{all_gather_object, CommError, ProcessGroup};

/// Why a [`DeviceMesh`] could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// The dimensions' sizes do not multiply to the group's size, or one
    /// is zero.
    #[error(
        "a mesh of shape {shape:?} ({}) does not fit a group of {world} ranks",
        describe(names, shape)
    )]
    Shape {
        /// The dimensions' names.
        names: Vec<String>,
        /// Their sizes.
        shape: Vec<usize>,
        /// The group's size.
        world: usize,
    },
    /// Two dimensions have one name, or a name is empty.
    #[error("mesh dimension names must be distinct and not empty: {names:?}")]
    Names {
        /// The names given.
        names: Vec<String>,
    },
    /// A dimension the mesh does not have.
    #[error("the mesh has no dimension `{name}`; it has {names:?}")]
    UnknownDim {
        /// The name asked for.
        name: String,
        /// The mesh's names.
        names: Vec<String>,
    },
    /// The ranks asked for different meshes.
    #[error("rank {rank} asked for the mesh {theirs}, rank 0 for {first}: every rank must ask for the same")]
    Differs {
        /// The first rank whose mesh differs from rank 0's.
        rank: usize,
        /// Its mesh.
        theirs: String,
        /// Rank 0's.
        first: String,
    },
    /// A mesh with another number of dimensions than its use takes.
    #[error("{expected}; this one has {}: {names:?}", names.len())]
    Dims {
        /// What the use takes.
        expected: String,
        /// The mesh's names.
        names: Vec<String>,
    },
    /// A collective failed while the mesh's groups were made.
    #[error(transparent)]
    Comm(#[from] CommError),
}

fn describe(names: &[String], shape: &[usize]) -> String {
    names
        .iter()
        .zip(shape)
        .map(|(n, s)| format!("{n}={s}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The ranks of a group laid out row-major in named dimensions
/// (PyTorch's `DeviceMesh`): with shape `[2, 4]` and names `["dp",
/// "shard"]`, rank `r` sits at `(r / 4, r % 4)`, so the last dimension
/// holds neighbouring ranks (keep it inside a machine). For each
/// dimension, this rank is a member of the sub-group of the ranks that
/// differ from it only along that dimension ([`group`](Self::group)), at
/// its coordinate there ([`local_rank`](Self::local_rank)).
///
/// Making a mesh is a collective of the group (one
/// [`split`](ProcessGroup::split) per dimension): every rank makes the
/// same mesh, in the same order as its other collectives. The mesh's
/// groups share the group's failures.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::comm::{DeviceMesh, ProcessGroup, ReduceOp};
/// use candle_dp::launch::spawn;
///
/// let seen = spawn(4, |ctx| {
///     let mesh = DeviceMesh::new(ctx.process_group(), &[("dp", 2), ("shard", 2)])?;
///     let x = Tensor::new(&[ctx.rank as f32], &Device::Cpu)?;
///     // Rank 3 is at (1, 1): its "dp" group is ranks 1 and 3.
///     let sum = mesh.group("dp")?.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
///     Ok((mesh.coordinate().to_vec(), sum))
/// })?;
/// assert_eq!(seen[3], (vec![1, 1], 4.0));
/// assert_eq!(seen[2], (vec![1, 0], 2.0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceMesh {
    world: Arc<dyn ProcessGroup>,
    names: Vec<String>,
    shape: Vec<usize>,
    coordinate: Vec<usize>,
    /// One group per dimension, through this rank.
    groups: Vec<SubGroup>,
}

impl DeviceMesh {
    /// Lays `world`'s ranks out in `dims` (name and size, outermost
    /// first) and makes each dimension's group.
    ///
    /// # Errors
    ///
    /// [`MeshError::Shape`] when the sizes do not multiply to the group's
    /// size; [`MeshError::Names`] for a repeated or empty name;
    /// [`MeshError::Differs`] naming the first rank that asked for another
    /// mesh (every rank gets the same error); a collective's error.
    pub fn new(world: Arc<dyn ProcessGroup>, dims: &[(&str, usize)]) -> Result<Self, MeshError> {
        let names: Vec<String> = dims.iter().map(|(n, _)| n.to_string()).collect();
        let shape: Vec<usize> = dims.iter().map(|&(_, s)| s).collect();
        let asked = describe(&names, &shape);
        let all = all_gather_object(world.as_ref(), &asked)?;
        if let Some(rank) = all.iter().position(|a| a != &all[0]) {
            return Err(MeshError::Differs {
                rank,
                theirs: all[rank].clone(),
                first: all[0].clone(),
            });
        }
        let distinct = names
            .iter()
            .enumerate()
            .all(|(i, n)| !n.is_empty() && !names[..i].contains(n));
        if !distinct {
            return Err(MeshError::Names { names });
        }
        let size = world.world_size();
        if shape.contains(&0) || shape.iter().product::<usize>() != size {
            return Err(MeshError::Shape {
                names,
                shape,
                world: size,
            });
        }
        let coordinate = coordinate_of(world.rank(), &shape);
        let mut groups = Vec::with_capacity(shape.len());
        for d in 0..shape.len() {
            // The ranks along dimension `d` through this rank: the same
            // coordinates elsewhere; their line is named by the rank at
            // coordinate 0 of `d`.
            let mut line = coordinate.clone();
            line[d] = 0;
            let color = Color::new(rank_of(&line, &shape) as u32);
            let group = world.split(color, coordinate[d] as i64)?;
            groups.push(group.ok_or_else(|| CommError::Protocol {
                rank: world.rank(),
                op: "split",
                peer: world.rank(),
                detail: "a coloured split gave this rank no group".into(),
            })?);
        }
        Ok(DeviceMesh {
            world,
            names,
            shape,
            coordinate,
            groups,
        })
    }

    fn dim(&self, name: &str) -> Result<usize, MeshError> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| MeshError::UnknownDim {
                name: name.to_string(),
                names: self.names.clone(),
            })
    }

    /// The group of the ranks along dimension `name` through this rank
    /// (PyTorch's `mesh.get_group(name)`).
    ///
    /// # Errors
    ///
    /// [`MeshError::UnknownDim`].
    pub fn group(&self, name: &str) -> Result<&SubGroup, MeshError> {
        Ok(&self.groups[self.dim(name)?])
    }

    /// This rank's coordinate along `name` (`mesh.get_local_rank(name)`),
    /// which is its rank in [`group(name)`](Self::group).
    ///
    /// # Errors
    ///
    /// [`MeshError::UnknownDim`].
    pub fn local_rank(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.coordinate[self.dim(name)?])
    }

    /// The size of dimension `name` (`mesh.size(name)`).
    ///
    /// # Errors
    ///
    /// [`MeshError::UnknownDim`].
    pub fn size(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.shape[self.dim(name)?])
    }

    /// The ranks of the whole group along `name` through this rank, in
    /// their order in [`group(name)`](Self::group).
    ///
    /// # Errors
    ///
    /// [`MeshError::UnknownDim`].
    pub fn ranks_along(&self, name: &str) -> Result<Vec<usize>, MeshError> {
        let d = self.dim(name)?;
        let mut at = self.coordinate.clone();
        Ok((0..self.shape[d])
            .map(|i| {
                at[d] = i;
                rank_of(&at, &self.shape)
            })
            .collect())
    }

    /// This rank's coordinates, one per dimension, outermost first.
    pub fn coordinate(&self) -> &[usize] {
        &self.coordinate
    }

    /// The dimensions' sizes, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dimensions' names, outermost first.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }

    /// The group the mesh lays out.
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("dims", &describe(&self.names, &self.shape))
            .field("rank", &self.world.rank())
            .field("coordinate", &self.coordinate)
            .finish_non_exhaustive()
    }
}

/// Rank `rank`'s coordinates in a row-major mesh of `shape`.
fn coordinate_of(rank: usize, shape: &[usize]) -> Vec<usize> {
    let mut rest = rank;
    let mut coordinate = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        coordinate[d] = rest % shape[d];
        rest /= shape[d];
    }
    coordinate
}

/// The rank at `coordinate` in a row-major mesh of `shape`.
fn rank_of(coordinate: &[usize], shape: &[usize]) -> usize {
    coordinate
        .iter()
        .zip(shape)
        .fold(0, |rank, (&c, &s)| rank * s + c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_are_row_major_and_lead_back_to_their_rank() {
        let shape = [2, 3, 2];
        assert_eq!(coordinate_of(7, &shape), [1, 0, 1]);
        for rank in 0..12 {
            assert_eq!(rank_of(&coordinate_of(rank, &shape), &shape), rank);
        }
    }
}
