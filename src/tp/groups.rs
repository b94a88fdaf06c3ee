//! Tensor- and data-parallel groups from one world: with TP size t, ranks `[k*t, (k+1)*t)` form a
//! tensor-parallel group, and ranks with the same position in their TP group form a data-parallel group
//! (4 ranks, t = 2: TP {0,1} {2,3}, DP {0,2} {1,3}).
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// This rank's tensor-parallel and data-parallel groups.
pub struct TpDpGroups {
    pub tp: ProcessGroup,
    pub dp: ProcessGroup,
}

impl TpDpGroups {
    pub fn new(world: &ProcessGroup, tp_size: usize) -> Result<TpDpGroups> {
        let n = world.size();
        if tp_size == 0 || !n.is_multiple_of(tp_size) {
            return Err(Error::invalid(
                "TpDpGroups::new",
                format!("world size {n} is not divisible by the tensor-parallel size {tp_size}"),
            ));
        }
        // the mesh [("dp", n / t), ("tp", t)]: TP groups are consecutive ranks, as Megatron and PyTorch lay them
        let layout = crate::mesh::MeshLayout::new(&[("dp", n / tp_size), ("tp", tp_size)])?;
        let r = world.rank();
        let tp_ranks = layout.group_ranks(r, "tp")?;
        let dp_ranks = layout.group_ranks(r, "dp")?;
        let missing = || Error::invalid("TpDpGroups::new", "this rank is not in its own group");
        let tp = world.new_subgroup(&tp_ranks, "tp")?.ok_or_else(missing)?;
        let dp = world.new_subgroup(&dp_ranks, "dp")?.ok_or_else(missing)?;
        Ok(TpDpGroups { tp, dp })
    }
}
