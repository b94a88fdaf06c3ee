//! Who writes what. Every rank describes the chunks it holds; every rank then computes the same plan
//! from all the descriptions: a chunk held by several ranks (replicated parameters, a TP shard repeated
//! across data-parallel ranks) is written once, by the holder with the fewest bytes assigned so far, so
//! the writing spreads over the ranks instead of piling onto rank 0. A buffer (a variable nothing trains)
//! is written by its lowest holder: ranks may have updated it apart.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::region::Bx;
use crate::error::{Error, Result};

/// One chunk a rank holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Desc {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
    pub bx: Bx,
    pub bytes: i64,
    /// A model variable nothing trains (a buffer): written by its lowest holder, so that buffers the ranks
    /// updated apart (batch norm's statistics under FSDP) come from one rank, not a mix of ranks.
    #[serde(default)]
    pub buffer: bool,
}

/// For each rank, the indices of its descriptions it writes. Fails, naming the tensor and the ranks, when
/// ranks disagree on a tensor's shape or dtype, or when no rank holds part of a tensor.
pub(crate) fn assign(all: &[Vec<Desc>]) -> Result<Vec<Vec<usize>>> {
    let what = "checkpoint save";
    // one shape and dtype per name
    let mut kinds: BTreeMap<&str, (&Desc, usize)> = BTreeMap::new();
    for (rank, descs) in all.iter().enumerate() {
        for d in descs {
            if !d.bx.fits(&d.shape) {
                return Err(Error::invalid(
                    what,
                    format!("{}: rank {rank}'s chunk {:?} lies outside the shape {:?}", d.name, d.bx, d.shape),
                ));
            }
            match kinds.get(d.name.as_str()) {
                Some((first, r)) if first.shape != d.shape || first.dtype != d.dtype => {
                    return Err(Error::mismatch(
                        what,
                        format!(
                            "{}: rank {r} has it as {:?} {}, rank {rank} as {:?} {}",
                            d.name, first.shape, first.dtype, d.shape, d.dtype
                        ),
                    ))
                }
                Some(_) => {}
                None => {
                    kinds.insert(&d.name, (d, rank));
                }
            }
        }
    }
    // holders of each distinct chunk
    let mut holders: BTreeMap<(&str, &Bx), Vec<(usize, usize)>> = BTreeMap::new();
    for (rank, descs) in all.iter().enumerate() {
        for (i, d) in descs.iter().enumerate() {
            holders.entry((d.name.as_str(), &d.bx)).or_default().push((rank, i));
        }
    }
    // every element of every tensor held by someone (the boxes of one tensor do not overlap)
    let mut covered: BTreeMap<&str, i64> = BTreeMap::new();
    for (name, bx) in holders.keys() {
        *covered.entry(name).or_default() += bx.volume();
    }
    for (name, (d, _)) in &kinds {
        let total: i64 = d.shape.iter().product();
        if covered.get(name).copied().unwrap_or(0) != total {
            return Err(Error::invalid(
                what,
                format!(
                    "{name}: the ranks' chunks cover {} of its {total} elements (shape {:?}); a shard missing, overlapping, or not marked as one",
                    covered.get(name).copied().unwrap_or(0),
                    d.shape
                ),
            ));
        }
    }
    // largest chunks first, each to its least-loaded holder
    type Held<'d> = (&'d (&'d str, &'d Bx), &'d Vec<(usize, usize)>);
    let mut chunks: Vec<Held> = holders.iter().collect();
    let bytes = |c: &Held| all[c.1[0].0][c.1[0].1].bytes;
    chunks.sort_by(|a, b| bytes(b).cmp(&bytes(a)).then_with(|| a.0.cmp(b.0)));
    let mut load = vec![0i64; all.len()];
    let mut out = vec![Vec::new(); all.len()];
    for (_, hs) in chunks {
        let &(rank, i) = if all[hs[0].0][hs[0].1].buffer {
            hs.iter().min_by_key(|(r, _)| *r)
        } else {
            hs.iter().min_by_key(|(r, _)| (load[*r], *r))
        }
        .expect("a chunk has a holder");
        load[rank] += all[rank][i].bytes;
        out[rank].push(i);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(name: &str, shape: &[i64], bx: Bx) -> Desc {
        let bytes = bx.volume() * 4;
        Desc { name: name.into(), shape: shape.to_vec(), dtype: "F32".into(), bx, bytes, buffer: false }
    }

    #[test]
    fn buffers_come_from_their_lowest_holder() {
        let buf = |n: &str| Desc { buffer: true, ..d(n, &[8], Bx::whole(&[8])) };
        let all: Vec<Vec<Desc>> =
            (0..2).map(|_| vec![buf("mean"), buf("var"), d("w", &[8], Bx::whole(&[8]))]).collect();
        let plan = assign(&all).unwrap();
        assert_eq!(plan[0].iter().filter(|&&i| i < 2).count(), 2, "{plan:?}");
        assert_eq!(plan[1], vec![2], "the parameter goes to the least-loaded holder: {plan:?}");
    }

    #[test]
    fn replicated_chunks_are_written_once_and_spread() {
        let all: Vec<Vec<Desc>> = (0..2)
            .map(|_| vec![d("a", &[8], Bx::whole(&[8])), d("b", &[8], Bx::whole(&[8])), d("c", &[], Bx::whole(&[]))])
            .collect();
        let plan = assign(&all).unwrap();
        assert_eq!(plan.iter().map(Vec::len).sum::<usize>(), 3);
        assert!(plan.iter().all(|p| !p.is_empty()), "{plan:?}");
    }

    #[test]
    fn disagreement_and_gaps_are_named() {
        let e = assign(&[vec![d("w", &[4], Bx::whole(&[4]))], vec![d("w", &[5], Bx::whole(&[5]))]]).unwrap_err();
        assert!(e.to_string().contains("w: rank 0 has it as [4]"), "{e}");
        let half = Bx { offsets: vec![0], lengths: vec![2] };
        let e = assign(&[vec![d("w", &[4], half.clone())], vec![d("w", &[4], half)]]).unwrap_err();
        assert!(e.to_string().contains("cover 2 of its 4 elements"), "{e}");
    }
}
