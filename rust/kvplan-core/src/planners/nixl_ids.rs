//! Descriptor ids in the layout of vLLM's NIXL connector (`_compute_desc_ids`).
//!
//! vLLM prepares one NIXL descriptor list per peer with one descriptor per (region, block):
//! region `r` holds `counts[r]` descriptors starting at `offsets[r]` (the exclusive prefix sum
//! of the counts), so block `b` of region `r` is descriptor `offsets[r] + b`. A request sends,
//! for its KV groups' block ids, the ids of every (region, block) it moves, in one of three
//! orders:
//!
//! * **layer routing** (a non-empty `layer_groups`: region `k` is layer `k`, fed by KV group
//!   `layer_groups[k]`): region major, each region's own group's blocks;
//! * **flat** (no region-to-group mapping): region major, every group's blocks concatenated
//!   (with the hybrid memory manager every group's layers share each region);
//! * **grouped**: group major; within a group, region major over the regions of that group
//!   or of the shared group `-1`; a group without blocks contributes nothing;
//! * **paired** (`pairs = (regions, keys)`, the handshake's region pairs of vLLM 0.34 and
//!   later): key major over the distinct keys in ascending order; within a key, the regions
//!   paired with it in pair order, each with the blocks `groups[key]` (a cache group's, or a
//!   region's for region-mapped reads). Regions and keys no pair names are not read.
//!
//! [`DescIdRequest`] carries vLLM's arguments and the worker attributes its method reads,
//! unresolved: the defaults are resolved here exactly as vLLM resolves them. What is refused
//! (each with the values): a block id outside its region (the id would name a descriptor of
//! the next region), a negative id or one past `i32::MAX` (vLLM holds block ids as int32), a
//! group with blocks but no region, a region count that disagrees with the counts, no region,
//! a block-size ratio that gives a negative or non-finite count. The checks are in `check`.
//!
//! Models with Mamba state regions use another layout (a fixed stride per region, state
//! descriptors after all attention descriptors) and are not expressed here.

use crate::error::{PlanError, Result};
use crate::rules::check;

/// vLLM's `block_size_ratio`: an integer (`int(count * ratio)` is exact) or a float (the count
/// converted to `f64`, multiplied, truncated toward zero, as Python's `int(count * ratio)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BlockScale {
    /// An integer ratio.
    Int(i64),
    /// A float ratio.
    Float(f64),
}

impl BlockScale {
    /// `int(count * ratio)`.
    ///
    /// # Errors
    /// [`PlanError::Overflow`] when the product leaves `i64`; [`PlanError::InvalidLayout`]
    /// when a float product is not finite.
    pub fn apply(self, count: i64) -> Result<i64> {
        match self {
            BlockScale::Int(ratio) => count.checked_mul(ratio).ok_or(PlanError::Overflow {
                what: "a region's block count times the block-size ratio",
            }),
            BlockScale::Float(ratio) => {
                // Python converts the int to the nearest float (ties to even), as `as` does:
                // the rounding is the one vLLM's `int(count * ratio)` performs.
                #[allow(clippy::cast_precision_loss)]
                let product = count as f64 * ratio;
                if !product.is_finite() {
                    return Err(PlanError::InvalidLayout {
                        what: format!(
                            "block count {count} times block-size ratio {ratio} is {product}, not a finite count"
                        ),
                    });
                }
                let truncated = product.trunc();
                if !(-TWO_63..TWO_63).contains(&truncated) {
                    return Err(PlanError::Overflow {
                        what: "a region's block count times the block-size ratio",
                    });
                }
                // in range and integral: exact
                #[allow(clippy::cast_possible_truncation)]
                Ok(truncated as i64)
            }
        }
    }
}

/// 2**63: the first float past `i64`.
const TWO_63: f64 = 9_223_372_036_854_775_808.0;

/// One `_compute_desc_ids` call: its arguments and the worker attributes it reads.
#[derive(Debug, Clone, Copy)]
pub struct DescIdRequest<'a> {
    /// `dst_num_blocks`: blocks per region when `region_num_blocks` is not given.
    pub num_blocks: i64,
    /// `block_size_ratio`.
    pub scale: Option<BlockScale>,
    /// `region_num_blocks` (each scaled by the ratio when one is given).
    pub region_num_blocks: Option<&'a [i64]>,
    /// The worker's `_transfer_layer_group_ids`: layer routing when non-empty.
    pub layer_groups: &'a [i64],
    /// The worker's `num_regions`.
    pub num_regions: usize,
    /// `len(worker.block_len_per_layer)`: the region count when `num_regions` is 0.
    pub num_layers: usize,
    /// `region_group_ids`.
    pub region_groups: Option<&'a [i64]>,
    /// The worker's `region_group_ids` (used when `region_groups` is `None`).
    pub worker_region_groups: &'a [i64],
    /// `uses_region_group_mapping`.
    pub grouped: Option<bool>,
    /// The worker's `_uses_region_group_mapping` (used when both `region_groups` and
    /// `grouped` are `None`).
    pub worker_grouped: bool,
    /// vLLM 0.34's `pairs = (regions, keys)`: when given, the paired order, and the layer
    /// routing and region group fields are not read.
    pub pairs: Option<(&'a [i64], &'a [i64])>,
}

/// The region group id of regions every KV group reads (vLLM's `_SHARED_REGION_GROUP_ID`).
pub(crate) const SHARED_REGION_GROUP: i64 = -1;

/// The descriptor ids of `groups` (one slice of block ids per KV group), as vLLM's
/// `_compute_desc_ids` returns them for a model without Mamba state (see the module
/// documentation).
///
/// # Errors
/// [`PlanError::DescIdOutOfRegion`] for a block id outside its region (or negative, or past
/// `i32::MAX`); [`PlanError::InvalidLayout`] for counts, regions or groups that do not fit
/// together; [`PlanError::Overflow`]; [`PlanError::OutOfMemory`].
pub fn desc_ids(request: &DescIdRequest<'_>, groups: &[&[i64]]) -> Result<Vec<i64>> {
    let num_blocks = match request.scale {
        Some(scale) => scale.apply(request.num_blocks)?,
        None => request.num_blocks,
    };
    let routing = request.pairs.is_none() && !request.layer_groups.is_empty();
    let mut n_regions = if routing {
        request.layer_groups.len()
    } else if request.num_regions != 0 {
        request.num_regions
    } else {
        request.num_layers
    };
    let counts: Vec<i64> = match request.region_num_blocks {
        None => vec![num_blocks; n_regions],
        Some(given) => match request.scale {
            Some(scale) => given
                .iter()
                .map(|&c| scale.apply(c))
                .collect::<Result<_>>()?,
            None => given.to_vec(),
        },
    };
    if !counts.is_empty() && !routing {
        n_regions = counts.len();
    }
    check::desc_id_regions(&counts, n_regions)?;
    let offsets = region_offsets(&counts)?;
    if let Some((regions, keys)) = request.pairs {
        return paired(regions, keys, &offsets, &counts, groups);
    }
    if routing {
        return routed(request.layer_groups, &offsets, &counts, groups);
    }
    let (region_groups, grouped) = match request.region_groups {
        Some(given) => (given, request.grouped),
        None => (
            request.worker_region_groups,
            request.grouped.or(Some(request.worker_grouped)),
        ),
    };
    let region_groups: &[i64] = if region_groups.is_empty() && n_regions == 1 {
        &[0]
    } else {
        region_groups
    };
    check::desc_id_region_groups(region_groups, n_regions)?;
    // vLLM's default: more than one distinct region group id
    let grouped = grouped.unwrap_or_else(|| {
        region_groups
            .first()
            .is_some_and(|first| region_groups.iter().any(|g| g != first))
    });
    if grouped {
        by_group(region_groups, &offsets, &counts, groups)
    } else {
        flat(&offsets, &counts, groups)
    }
}

/// The exclusive prefix sum of the counts.
fn region_offsets(counts: &[i64]) -> Result<Vec<i64>> {
    let mut offsets = Vec::with_capacity(counts.len());
    let mut total: i64 = 0;
    for &count in counts {
        offsets.push(total);
        total = total.checked_add(count).ok_or(PlanError::Overflow {
            what: "the descriptor offset of a region",
        })?;
    }
    Ok(offsets)
}

fn output(n: Option<usize>) -> Result<Vec<i64>> {
    let n = n.ok_or(PlanError::Overflow {
        what: "the descriptor id count",
    })?;
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| PlanError::out_of_memory::<i64>("descriptor ids", n))?;
    Ok(out)
}

fn push_region(out: &mut Vec<i64>, offset: i64, blocks: &[i64]) {
    // Every block was checked to lie in 0..count, and offset + count did not overflow.
    out.extend(blocks.iter().map(|&b| offset + b));
}

fn routed(
    layer_groups: &[i64],
    offsets: &[i64],
    counts: &[i64],
    groups: &[&[i64]],
) -> Result<Vec<i64>> {
    let mut total: Option<usize> = Some(0);
    for (region, &group) in layer_groups.iter().enumerate() {
        let g = check::desc_id_group(group, region, groups.len())?;
        check::desc_id_blocks(g, groups[g], region, counts[region])?;
        total = total.and_then(|t| t.checked_add(groups[g].len()));
    }
    let mut out = output(total)?;
    for (region, &group) in layer_groups.iter().enumerate() {
        // checked above: a valid index
        let blocks = groups[usize::try_from(group).unwrap_or_default()];
        push_region(&mut out, offsets[region], blocks);
    }
    Ok(out)
}

fn paired(
    regions: &[i64],
    keys: &[i64],
    offsets: &[i64],
    counts: &[i64],
    groups: &[&[i64]],
) -> Result<Vec<i64>> {
    if regions.len() != keys.len() {
        return Err(PlanError::InvalidLayout {
            what: format!(
                "descriptor ids: {} paired regions for {} pair keys",
                regions.len(),
                keys.len()
            ),
        });
    }
    let mut order: Vec<(usize, usize)> = Vec::with_capacity(regions.len());
    for (pair, (&region, &key)) in regions.iter().zip(keys).enumerate() {
        let r = usize::try_from(region)
            .ok()
            .filter(|&r| r < counts.len())
            .ok_or_else(|| PlanError::InvalidLayout {
                what: format!(
                    "descriptor ids: pair {pair} reads region {region} but there are {} descriptor regions",
                    counts.len()
                ),
            })?;
        let k = usize::try_from(key)
            .ok()
            .filter(|&k| k < groups.len())
            .ok_or_else(|| PlanError::InvalidLayout {
                what: format!(
                    "descriptor ids: pair {pair} reads block list {key} but the request has {} block lists",
                    groups.len()
                ),
            })?;
        order.push((k, r));
    }
    // key major in ascending key order, pair order within a key (a stable sort)
    order.sort_by_key(|&(k, _)| k);
    let mut total: Option<usize> = Some(0);
    for &(k, r) in &order {
        check::desc_id_blocks(k, groups[k], r, counts[r])?;
        total = total.and_then(|t| t.checked_add(groups[k].len()));
    }
    let mut out = output(total)?;
    for &(k, r) in &order {
        push_region(&mut out, offsets[r], groups[k]);
    }
    Ok(out)
}

fn flat(offsets: &[i64], counts: &[i64], groups: &[&[i64]]) -> Result<Vec<i64>> {
    check::desc_id_any_group(groups)?;
    // The region with the fewest blocks (the first of them) bounds every region.
    let (tightest, &min_count) =
        counts
            .iter()
            .enumerate()
            .min_by_key(|&(_, c)| *c)
            .ok_or(PlanError::InvalidLayout {
                what: "no descriptor region".into(),
            })?;
    let mut per_region: usize = 0;
    for (g, blocks) in groups.iter().enumerate() {
        check::desc_id_blocks(g, blocks, tightest, min_count)?;
        per_region += blocks.len();
    }
    let mut out = output(per_region.checked_mul(offsets.len()))?;
    for &offset in offsets {
        for blocks in groups {
            push_region(&mut out, offset, blocks);
        }
    }
    Ok(out)
}

fn by_group(
    region_groups: &[i64],
    offsets: &[i64],
    counts: &[i64],
    groups: &[&[i64]],
) -> Result<Vec<i64>> {
    let regions_of = |g: usize| {
        region_groups
            .iter()
            .enumerate()
            .filter(move |&(_, &rg)| rg == SHARED_REGION_GROUP || usize::try_from(rg) == Ok(g))
            .map(|(r, _)| r)
    };
    let mut total: Option<usize> = Some(0);
    for (g, blocks) in groups.iter().enumerate() {
        if blocks.is_empty() {
            continue;
        }
        let mut n = 0usize;
        for region in regions_of(g) {
            check::desc_id_blocks(g, blocks, region, counts[region])?;
            n += 1;
        }
        check::desc_id_group_regions(g, n, region_groups)?;
        total = total.and_then(|t| t.checked_add(blocks.len().checked_mul(n)?));
    }
    let mut out = output(total)?;
    for (g, blocks) in groups.iter().enumerate() {
        if blocks.is_empty() {
            continue;
        }
        for region in regions_of(g) {
            push_region(&mut out, offsets[region], blocks);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<'a>() -> DescIdRequest<'a> {
        DescIdRequest {
            num_blocks: 10,
            scale: None,
            region_num_blocks: None,
            layer_groups: &[],
            num_regions: 3,
            num_layers: 3,
            region_groups: None,
            worker_region_groups: &[0, 0, 0],
            grouped: None,
            worker_grouped: false,
            pairs: None,
        }
    }

    #[test]
    fn pairs_are_key_major_in_pair_order() {
        let r = DescIdRequest {
            region_num_blocks: Some(&[4, 5, 6]),
            pairs: Some((&[2, 0, 1, 0], &[1, 0, 1, 1])),
            ..request()
        };
        // key 0: region 0; key 1: regions 2, 1, 0 (pair order)
        assert_eq!(
            desc_ids(&r, &[&[3], &[1, 2]]).unwrap(),
            vec![3, 10, 11, 5, 6, 1, 2]
        );
        let err = desc_ids(&r, &[&[3], &[4]]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "KV group 1: block id 4 at position 0 is outside 0..4, the blocks of descriptor region 0"
        );
        let r = DescIdRequest {
            pairs: Some((&[0, 3], &[0, 0])),
            ..r
        };
        let err = desc_ids(&r, &[&[1]]).unwrap_err();
        assert!(err.to_string().contains("pair 1 reads region 3"), "{err}");
        let r = DescIdRequest {
            pairs: Some((&[0], &[-1])),
            ..r
        };
        let err = desc_ids(&r, &[&[1]]).unwrap_err();
        assert!(
            err.to_string().contains("pair 0 reads block list -1"),
            "{err}"
        );
    }

    #[test]
    fn flat_is_region_major_over_every_group() {
        let ids = desc_ids(&request(), &[&[1, 2], &[3]]).unwrap();
        assert_eq!(ids, vec![1, 2, 3, 11, 12, 13, 21, 22, 23]);
    }

    #[test]
    fn grouped_uses_each_groups_regions_and_shared_ones() {
        let r = DescIdRequest {
            worker_region_groups: &[0, 1, -1],
            worker_grouped: true,
            ..request()
        };
        let ids = desc_ids(&r, &[&[1], &[2]]).unwrap();
        assert_eq!(ids, vec![1, 21, 12, 22]);
        let r = DescIdRequest {
            worker_region_groups: &[0, 1, 1],
            ..r
        };
        assert_eq!(desc_ids(&r, &[&[1], &[], &[]]).unwrap(), vec![1]);
        let err = desc_ids(&r, &[&[1], &[], &[2]]).unwrap_err();
        assert!(err.to_string().contains("KV group 2"), "{err}");
    }

    #[test]
    fn routing_takes_each_layers_group() {
        let r = DescIdRequest {
            layer_groups: &[1, 0],
            region_num_blocks: Some(&[4, 5]),
            ..request()
        };
        assert_eq!(desc_ids(&r, &[&[0, 3], &[2]]).unwrap(), vec![2, 4, 7]);
    }

    #[test]
    fn scale_truncates_like_python() {
        assert_eq!(BlockScale::Float(0.5).apply(7).unwrap(), 3);
        assert_eq!(BlockScale::Int(4).apply(7).unwrap(), 28);
        assert!(BlockScale::Float(f64::NAN).apply(7).is_err());
    }

    #[test]
    fn a_block_past_its_region_is_refused_with_its_values() {
        let r = DescIdRequest {
            region_num_blocks: Some(&[10, 4, 10]),
            ..request()
        };
        let err = desc_ids(&r, &[&[1, 5]]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "KV group 0: block id 5 at position 1 is outside 0..4, the blocks of descriptor region 1"
        );
    }
}
