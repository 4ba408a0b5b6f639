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
        agree(world.as_ref(), describe(&names, &shape))?;
        check_distinct(&names)?;
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
            groups.push(split_line(world.as_ref(), rank_of(&line, &shape))?);
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

    /// The mesh of dimensions `names` through this rank (PyTorch's
    /// `mesh["dp_replicate", "dp_shard"]`): the ranks that share this
    /// rank's coordinates along the other dimensions, laid out in `names`.
    /// Its groups along `names` are this mesh's; its
    /// [`world`](Self::world) is the group of all its ranks. Every rank
    /// of the mesh calls it, with the same names.
    ///
    /// ```
    /// use candle_dp::comm::{DeviceMesh, ProcessGroup};
    ///
    /// let seen = candle_dp::launch::spawn(8, |ctx| {
    ///     let mesh = DeviceMesh::new(ctx.process_group(), &[("dp", 2), ("pp", 2), ("tp", 2)])?;
    ///     let data = mesh.sub_mesh(&["dp", "pp"])?;
    ///     Ok((data.world().world_size(), data.coordinate().to_vec()))
    /// })?;
    /// // Rank 5 is at (1, 0, 1): among the ranks at tp = 1 it is (1, 0).
    /// assert_eq!(seen[5], (4, vec![1, 0]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`MeshError::UnknownDim`]; [`MeshError::Dims`] for names out of
    /// the mesh's order, repeated or none; [`MeshError::Differs`] naming a
    /// rank that asked for other names; a collective's error.
    pub fn sub_mesh(&self, names: &[&str]) -> Result<DeviceMesh, MeshError> {
        let dims = self.dims_in_order(names)?;
        agree(self.world.as_ref(), format!("sub_mesh({names:?})"))?;
        let world = self.span(&dims)?;
        Ok(DeviceMesh {
            world,
            names: dims.iter().map(|&d| self.names[d].clone()).collect(),
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            coordinate: dims.iter().map(|&d| self.coordinate[d]).collect(),
            groups: dims.iter().map(|&d| Arc::clone(&self.groups[d])).collect(),
        })
    }

    /// This mesh with the neighbouring dimensions `names` made one,
    /// called `as_name` (PyTorch's `mesh["dp_replicate",
    /// "dp_shard"]._flatten("dp")`): its size their product, its group
    /// the ranks along any of them, row-major. Every rank of the mesh
    /// calls it, with the same names.
    ///
    /// ```
    /// use candle_dp::comm::{DeviceMesh, ProcessGroup};
    ///
    /// let seen = candle_dp::launch::spawn(8, |ctx| {
    ///     let dims = [("dp_replicate", 2), ("dp_shard", 2), ("pp", 2)];
    ///     let mesh = DeviceMesh::new(ctx.process_group(), &dims)?;
    ///     let mesh = mesh.flatten(&["dp_replicate", "dp_shard"], "dp")?;
    ///     Ok((mesh.shape().to_vec(), mesh.local_rank("dp")?))
    /// })?;
    /// // Rank 6 is at (1, 1, 0): the fourth replica of its stage.
    /// assert_eq!(seen[6], (vec![4, 2], 3));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`sub_mesh`](Self::sub_mesh), and [`MeshError::Dims`] for
    /// dimensions that are not neighbours; [`MeshError::Names`] for an
    /// `as_name` another dimension has.
    pub fn flatten(&self, names: &[&str], as_name: &str) -> Result<DeviceMesh, MeshError> {
        let dims = self.dims_in_order(names)?;
        let (first, last) = (dims[0], dims[dims.len() - 1]);
        if last - first + 1 != dims.len() {
            return Err(MeshError::Dims {
                expected: format!("flattening takes neighbouring dimensions, not {names:?}"),
                names: self.names.clone(),
            });
        }
        let mut new_names = self.names[..first].to_vec();
        new_names.push(as_name.to_string());
        new_names.extend_from_slice(&self.names[last + 1..]);
        check_distinct(&new_names)?;
        agree(
            self.world.as_ref(),
            format!("flatten({names:?}, {as_name:?})"),
        )?;
        let group = self.span(&dims)?;
        let merged = first..last + 1;
        let mut shape = self.shape[..first].to_vec();
        shape.push(self.shape[merged.clone()].iter().product());
        shape.extend_from_slice(&self.shape[last + 1..]);
        let mut coordinate = self.coordinate[..first].to_vec();
        coordinate.push(rank_of(
            &self.coordinate[merged.clone()],
            &self.shape[merged],
        ));
        coordinate.extend_from_slice(&self.coordinate[last + 1..]);
        let mut groups = self.groups[..first].to_vec();
        groups.push(group);
        groups.extend_from_slice(&self.groups[last + 1..]);
        Ok(DeviceMesh {
            world: Arc::clone(&self.world),
            names: new_names,
            shape,
            coordinate,
            groups,
        })
    }

    /// The positions of `names`, which must be the mesh's, in its order,
    /// each once, at least one.
    fn dims_in_order(&self, names: &[&str]) -> Result<Vec<usize>, MeshError> {
        let dims = names
            .iter()
            .map(|n| self.dim(n))
            .collect::<Result<Vec<_>, _>>()?;
        if dims.is_empty() || dims.windows(2).any(|w| w[0] >= w[1]) {
            return Err(MeshError::Dims {
                expected: format!(
                    "a sub-mesh names dimensions in the mesh's order, each once, not {names:?}"
                ),
                names: self.names.clone(),
            });
        }
        Ok(dims)
    }

    /// The group of the ranks that differ from this one along `dims`
    /// only, ordered row-major over them.
    fn span(&self, dims: &[usize]) -> Result<SubGroup, MeshError> {
        let mut base = self.coordinate.clone();
        for &d in dims {
            base[d] = 0;
        }
        split_line(self.world.as_ref(), rank_of(&base, &self.shape))
    }
}

/// Fails every rank alike, naming the first whose `asked` differs from
/// rank 0's.
fn agree(world: &dyn ProcessGroup, asked: String) -> Result<(), MeshError> {
    let all = all_gather_object(world, &asked)?;
    match all.iter().position(|a| a != &all[0]) {
        Some(rank) => Err(MeshError::Differs {
            rank,
            theirs: all[rank].clone(),
            first: all[0].clone(),
        }),
        None => Ok(()),
    }
}

fn check_distinct(names: &[String]) -> Result<(), MeshError> {
    let distinct = names
        .iter()
        .enumerate()
        .all(|(i, n)| !n.is_empty() && !names[..i].contains(n));
    match distinct {
        true => Ok(()),
        false => Err(MeshError::Names {
            names: names.to_vec(),
        }),
    }
}

/// This rank's group among those of `world` that give the same `line`
/// (the rank at the start of their line), ordered by their ranks.
fn split_line(world: &dyn ProcessGroup, line: usize) -> Result<SubGroup, MeshError> {
    let group = world.split(Color::new(line as u32), world.rank() as i64)?;
    Ok(group.ok_or_else(|| CommError::Protocol {
        rank: world.rank(),
        op: "split",
        peer: world.rank(),
        detail: "a coloured split gave this rank no group".into(),
    })?)
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
