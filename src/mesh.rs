//! A device mesh (PyTorch's `init_device_mesh`): the world's ranks laid out row-major over named
//! dimensions, with one process group per dimension for each rank: the ranks that differ from it in that
//! coordinate only. With `[("pp", 2), ("dp", 2), ("tp", 2)]` on 8 ranks, rank 5 sits at (1, 0, 1); its
//! "tp" group is ranks 4 and 5, its "dp" group 5 and 7, its "pp" group 1 and 5 — the same layout and
//! groups as PyTorch's for the same shape (`tests/tp/mesh.rs` asks PyTorch).
//!
//! ```no_run
//! use tch_dist::mesh::DeviceMesh;
//! let world = tch_dist::ProcessGroup::from_env()?;
//! let mesh = DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)])?;
//! let tp = mesh.group("tp")?; // tensor-parallel layers take this one
//! let dp = mesh.group("dp")?; // DDP / FSDP over this one
//! println!("rank {} at {:?}", world.rank(), mesh.coordinates());
//! # Ok::<(), tch_dist::Error>(())
//! ```
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// The most dimensions a mesh may have.
pub const MAX_DIMS: usize = 8;

/// Named dimensions and their sizes: rank ↔ coordinates, and who shares a group along a dimension.
/// Plain data: no communication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshLayout {
    names: Vec<String>,
    shape: Vec<usize>,
}

impl MeshLayout {
    /// Dimensions outermost first (the last one varies fastest across consecutive ranks).
    pub fn new(dims: &[(&str, usize)]) -> Result<MeshLayout> {
        let what = "DeviceMesh";
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(Error::invalid(what, format!("a mesh has 1 to {MAX_DIMS} dimensions, not {}", dims.len())));
        }
        for (i, (n, size)) in dims.iter().enumerate() {
            if *size == 0 {
                return Err(Error::invalid(what, format!("dimension {n:?} has size 0")));
            }
            if n.is_empty() || dims[..i].iter().any(|(m, _)| m == n) {
                return Err(Error::invalid(what, format!("dimension names must be distinct and non-empty, not {n:?}")));
            }
        }
        Ok(MeshLayout {
            names: dims.iter().map(|(n, _)| n.to_string()).collect(),
            shape: dims.iter().map(|d| d.1).collect(),
        })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of ranks the mesh lays out.
    pub fn world(&self) -> usize {
        self.shape.iter().product()
    }

    /// The index of dimension `name`.
    pub fn dim(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            Error::invalid("DeviceMesh", format!("no dimension {name:?} (the mesh has {:?})", self.names))
        })
    }

    /// The size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize> {
        Ok(self.shape[self.dim(name)?])
    }

    /// `rank`'s coordinates, one per dimension.
    pub fn coordinates(&self, rank: usize) -> Result<Vec<usize>> {
        if rank >= self.world() {
            return Err(Error::invalid(
                "DeviceMesh",
                format!("rank {rank} is outside a mesh of {} ranks", self.world()),
            ));
        }
        let mut left = rank;
        let mut c = vec![0; self.shape.len()];
        for (i, s) in self.shape.iter().enumerate().rev() {
            c[i] = left % s;
            left /= s;
        }
        Ok(c)
    }

    /// The rank at `coords`.
    pub fn rank(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.shape.len() || coords.iter().zip(&self.shape).any(|(c, s)| c >= s) {
            return Err(Error::invalid(
                "DeviceMesh",
                format!("coordinates {coords:?} are outside the mesh {:?} of shape {:?}", self.names, self.shape),
            ));
        }
        Ok(coords.iter().zip(&self.shape).fold(0, |r, (c, s)| r * s + c))
    }

    /// The ranks of `rank`'s group over several dimensions at once (PyTorch's `mesh[names]._flatten()`):
    /// those equal to it outside `names`, ordered row-major over `names` in the mesh's order.
    pub fn flat_group_ranks(&self, rank: usize, names: &[&str]) -> Result<Vec<usize>> {
        let mut dims = names.iter().map(|n| self.dim(n)).collect::<Result<Vec<_>>>()?;
        dims.sort_unstable();
        if dims.is_empty() || dims.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid("DeviceMesh", format!("flatten {names:?}: name distinct dimensions")));
        }
        let mut ranks = vec![self.coordinates(rank)?];
        for &d in &dims {
            ranks = ranks
                .into_iter()
                .flat_map(|c| {
                    (0..self.shape[d]).map(move |i| {
                        let mut c = c.clone();
                        c[d] = i;
                        c
                    })
                })
                .collect();
        }
        ranks.iter().map(|c| self.rank(c)).collect()
    }

    /// The ranks of `rank`'s group along `name`: those equal to it in every other coordinate, in the
    /// order of their coordinate along `name` (rank `i` of that group has coordinate `i`).
    pub fn group_ranks(&self, rank: usize, name: &str) -> Result<Vec<usize>> {
        let d = self.dim(name)?;
        let mut c = self.coordinates(rank)?;
        (0..self.shape[d])
            .map(|i| {
                c[d] = i;
                self.rank(&c)
            })
            .collect()
    }
}

/// This rank's place in a [`MeshLayout`] and its group along each dimension.
pub struct DeviceMesh {
    layout: MeshLayout,
    coords: Vec<usize>,
    groups: Vec<Arc<ProcessGroup>>,
}

impl DeviceMesh {
    /// Lays `world`'s ranks out over `dims` (outermost first) and builds this rank's group along each
    /// dimension (with `world`'s backends). Every rank of `world` calls it with the same dimensions; the
    /// sizes' product must be the world size. Ranks that disagree get an error naming each one's mesh.
    pub fn new(world: &ProcessGroup, dims: &[(&str, usize)]) -> Result<DeviceMesh> {
        let layout = MeshLayout::new(dims)?;
        if layout.world() != world.size() {
            return Err(Error::invalid(
                "DeviceMesh",
                format!("the mesh {dims:?} holds {} ranks, the group {}", layout.world(), world.size()),
            ));
        }
        // every rank must build the same mesh: the shape (padded to a fixed length, since a gather of
        // unequal lengths aborts Gloo) and a digest of the names
        let digest = layout
            .names
            .join("\u{1}")
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
        let mut mine = vec![0i64; 2 + MAX_DIMS];
        mine[0] = (digest >> 1) as i64;
        mine[1] = layout.shape.len() as i64;
        layout.shape.iter().enumerate().for_each(|(i, &s)| mine[2 + i] = s as i64);
        world.meta().agree("DeviceMesh layout", &mine, |rows| {
            let show = |r: &[i64]| format!("shape {:?}", &r[2..2 + r[1] as usize]);
            format!("ranks build different meshes: {}", crate::group::meta::by_rank(rows, show, "; "))
        })?;
        let coords = layout.coordinates(world.rank())?;
        let mut groups = Vec::with_capacity(dims.len());
        for (name, _) in dims {
            let ranks = layout.group_ranks(world.rank(), name)?;
            let g = world
                .new_partition_subgroup(&ranks, &format!("mesh-{name}"))?
                .ok_or_else(|| Error::invalid("DeviceMesh", "this rank is not in its own group"))?;
            groups.push(Arc::new(g));
        }
        Ok(DeviceMesh { layout, coords, groups })
    }

    pub fn layout(&self) -> &MeshLayout {
        &self.layout
    }

    /// This rank's coordinates (PyTorch's `get_coordinate`).
    pub fn coordinates(&self) -> &[usize] {
        &self.coords
    }

    /// This rank's coordinate along `name`: its rank in [`group`](Self::group)`(name)` (PyTorch's
    /// `get_local_rank`).
    pub fn coordinate(&self, name: &str) -> Result<usize> {
        Ok(self.coords[self.layout.dim(name)?])
    }

    /// The size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize> {
        self.layout.size(name)
    }

    /// This rank's group over the dimensions `names` together (PyTorch's `mesh[names]._flatten()`; data
    /// parallelism over the data- and context-parallel ranks, say): built here from `world`, the group
    /// the mesh was built from, so every rank of it calls this alike. Rank `i` of the result is the
    /// `i`-th, row-major, over `names` in the mesh's order; one name (or one of size above 1) gives that
    /// dimension's group. Each call forms a new group (its own communicator, a formation of its own):
    /// calling again works, and costs another group, so keep the first.
    pub fn flatten(&self, world: &ProcessGroup, names: &[&str]) -> Result<Arc<ProcessGroup>> {
        // dimensions of size 1 add no rank: with at most one left, that dimension's group is the answer
        let wide = names.iter().map(|n| Ok((*n, self.size(n)?))).collect::<Result<Vec<_>>>()?;
        let names: Vec<&str> = wide.iter().filter(|(_, s)| *s > 1).map(|(n, _)| *n).collect();
        match (&names[..], wide.first()) {
            ([one], _) | ([], Some((one, _))) => return self.group(one),
            _ => {}
        }
        if world.size() != self.layout.world() || self.layout.coordinates(world.rank())? != self.coords {
            return Err(Error::invalid("DeviceMesh::flatten", "give the group the mesh was built from"));
        }
        let ranks = self.layout.flat_group_ranks(world.rank(), &names)?;
        let g = world
            .new_partition_subgroup(&ranks, &format!("mesh-{}", names.join("_")))?
            .ok_or_else(|| Error::invalid("DeviceMesh::flatten", "this rank is not in its own group"))?;
        Ok(Arc::new(g))
    }

    /// This rank's group along `name` (PyTorch's `get_group`).
    pub fn group(&self, name: &str) -> Result<Arc<ProcessGroup>> {
        Ok(self.groups[self.layout.dim(name)?].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::MeshLayout;

    #[test]
    fn flattened_groups_are_row_major_over_their_dimensions() {
        let m = MeshLayout::new(&[("pp", 2), ("dp", 2), ("cp", 2), ("tp", 2)]).unwrap();
        // rank 5 is at (0, 1, 0, 1): its dp x cp group varies those two with pp 0, tp 1
        assert_eq!(m.flat_group_ranks(5, &["dp", "cp"]).unwrap(), vec![1, 3, 5, 7]);
        assert_eq!(m.flat_group_ranks(5, &["cp", "dp"]).unwrap(), vec![1, 3, 5, 7]);
        assert_eq!(m.flat_group_ranks(5, &["pp", "tp"]).unwrap(), vec![4, 5, 12, 13]);
        assert_eq!(m.flat_group_ranks(5, &["tp"]).unwrap(), m.group_ranks(5, "tp").unwrap());
        assert!(m.flat_group_ranks(5, &["dp", "dp"]).is_err());
        assert!(m.flat_group_ranks(5, &["ep"]).is_err());
    }
}
