//! Failure verdicts: the destination pages, per pool (the engines' KV-cache groups), and the
//! state slots that the failed blocks of a plan or a batch were to write, per request.
//!
//! A block's destination bytes are walked through the decode's layout: each stretch of them
//! lies in one item of one destination entry, and that item is a page of the entry's pool (or
//! a state slot), so a failed block names exactly the pages it touches, whatever the emission
//! (coalesced runs, groups of entries side by side, head fragments, token rows). Equal page ids
//! of different pools are different pages and stay apart. In a batch, each page is named for
//! the request whose destination lists hold it (a batch never gives one page to two requests),
//! so a block that crosses from one request into the next names each its own pages.

use std::ops::Range;

use crate::error::{PlanError, Result, Side};
use crate::model::request::{Indices, Request};
use crate::model::runs::PageIndex;
use crate::peer::entry::{EntryKind, POOLS, PoolId};
use crate::peer::layout::Layout;
use crate::planners::batch::BatchSummary;

/// The destination pages and slots some failed blocks were to write.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FailedPages {
    /// Per pool with at least one failed page, in pool order: the pool and its sorted, unique
    /// page ids.
    pub pools: Vec<(PoolId, Vec<i64>)>,
    /// The sorted, unique state slots (of state entries) the failed blocks were to write.
    pub slots: Vec<i64>,
}

impl FailedPages {
    /// Whether no page and no slot failed.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty() && self.slots.is_empty()
    }

    /// The failed pages of pool `pool` (empty when none failed).
    pub fn pages(&self, pool: PoolId) -> &[i64] {
        self.pools
            .iter()
            .find(|(p, _)| *p == pool)
            .map_or(&[], |(_, pages)| pages.as_slice())
    }
}

/// One request of a batch with failed pages or slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFailure {
    /// The request's position in the batch.
    pub request: usize,
    /// Its failed pages and slots.
    pub pages: FailedPages,
}

/// Where one stretch of destination bytes lands: a page of a pool, or a state slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Item {
    Page(PoolId, i64),
    Slot(i64),
}

/// The decode's entries sorted by buffer start, with the furthest buffer end up to each, so the
/// entries holding an address are found without a scan of every entry.
struct EntryIndex<'l> {
    layout: &'l Layout,
    /// Entry positions (elided entries left out) by buffer start.
    order: Vec<usize>,
    /// `reach[k]`: the furthest buffer end of `order[..=k]`.
    reach: Vec<u64>,
}

impl<'l> EntryIndex<'l> {
    fn new(layout: &'l Layout) -> Result<Self> {
        let entries = layout.entries();
        let mut order = Vec::new();
        order
            .try_reserve_exact(entries.len())
            .map_err(|_| PlanError::out_of_memory::<usize>("failure verdict", entries.len()))?;
        order.extend((0..entries.len()).filter(|&e| entries[e].item_len > 0));
        order.sort_unstable_by_key(|&e| entries[e].buffer.0);
        let mut reach = Vec::new();
        reach
            .try_reserve_exact(order.len())
            .map_err(|_| PlanError::out_of_memory::<u64>("failure verdict", order.len()))?;
        let mut furthest = 0u64;
        for &e in &order {
            let (base, len) = entries[e].buffer;
            furthest = furthest.max(base.saturating_add(len));
            reach.push(furthest);
        }
        Ok(Self {
            layout,
            order,
            reach,
        })
    }

    /// The item holding byte `addr` and the end of the bytes from `addr` on that the same item
    /// (or, for pages stored back to back, the same entry) holds: `(first item, last item,
    /// end)`, or `None` when no entry's item holds the byte.
    fn locate(&self, addr: u64, limit: u64) -> Option<(Item, Item, u64)> {
        let entries = self.layout.entries();
        let mut k = self.order.partition_point(|&e| entries[e].buffer.0 <= addr);
        while k > 0 {
            k -= 1;
            if self.reach[k] <= addr {
                break;
            }
            let entry = &entries[self.order[k]];
            let (base, len) = entry.buffer;
            // Whole items that fit: the last may end before a full stride does.
            let capacity = match len.checked_sub(entry.item_len) {
                Some(room) => room / entry.stride.max(1) + 1,
                None => 0,
            };
            let offset = addr - base;
            let index = offset / entry.stride.max(1);
            if index >= capacity || offset % entry.stride.max(1) >= entry.item_len {
                continue;
            }
            // Items stored back to back are one stretch; otherwise the item ends the stretch.
            let end = if entry.stride == entry.item_len {
                base + capacity * entry.stride
            } else {
                base + index * entry.stride + entry.item_len
            };
            let end = end.min(limit);
            let last = (end - 1 - base) / entry.stride.max(1);
            let item = |i: u64| match entry.kind {
                EntryKind::Page { pool, .. } => Item::Page(pool, i as i64),
                // A ring-state entry's items are rows, `ring` of them per request slot.
                EntryKind::State { ring, .. } => Item::Slot((i / ring.unwrap_or(1).max(1)) as i64),
            };
            return Some((item(index), item(last), end));
        }
        None
    }
}

/// Collected pages per pool and slots, sorted and deduplicated at the end.
#[derive(Default)]
struct Collect {
    pools: [Vec<i64>; POOLS],
    slots: Vec<i64>,
}

impl Collect {
    fn add(&mut self, first: Item, last: Item) -> Result<()> {
        let (list, lo, hi) = match (first, last) {
            (Item::Page(pool, lo), Item::Page(_, hi)) => (&mut self.pools[pool.index()], lo, hi),
            (Item::Slot(lo), Item::Slot(hi)) => (&mut self.slots, lo, hi),
            _ => return Err(PlanError::InputChanged),
        };
        let n = (hi - lo + 1) as usize;
        list.try_reserve(n)
            .map_err(|_| PlanError::out_of_memory::<i64>("failure verdict", n))?;
        list.extend(lo..=hi);
        Ok(())
    }

    fn finish(mut self) -> FailedPages {
        let mut pools = Vec::new();
        for (p, pages) in self.pools.iter_mut().enumerate() {
            let pool = PoolId::ALL[p];
            if pages.is_empty() {
                continue;
            }
            pages.sort_unstable();
            pages.dedup();
            pools.push((pool, std::mem::take(pages)));
        }
        self.slots.sort_unstable();
        self.slots.dedup();
        FailedPages {
            pools,
            slots: self.slots,
        }
    }
}

/// Checks the plan's columns and the failed ranges against each other.
fn check_input(dst_addrs: &[u64], lengths: &[u64], failed: &[Range<usize>]) -> Result<()> {
    if dst_addrs.len() != lengths.len() {
        return Err(failure_error(format!(
            "dst_addrs has {} blocks but lengths has {}; give both columns of one plan",
            dst_addrs.len(),
            lengths.len()
        )));
    }
    let n = dst_addrs.len();
    for (k, range) in failed.iter().enumerate() {
        if range.start > range.end {
            return Err(failure_error(format!(
                "failed range {k} is [{}, {}): its start is past its end",
                range.start, range.end
            )));
        }
        if range.end > n {
            return Err(failure_error(format!(
                "failed range {k} is [{}, {}) but the plan has {n} blocks (0..{n})",
                range.start, range.end
            )));
        }
    }
    Ok(())
}

fn failure_error(what: String) -> PlanError {
    PlanError::FailedBlocks { what }
}

/// Walks block `b`'s destination bytes through the decode's entries into `out`.
fn walk_block(
    index: &EntryIndex<'_>,
    b: usize,
    dst_addrs: &[u64],
    lengths: &[u64],
    out: &mut Collect,
) -> Result<()> {
    let (start, len) = (dst_addrs[b], lengths[b]);
    let Some(end) = start.checked_add(len) else {
        return Err(failure_error(format!(
            "block {b} at {start:#x} of {len} bytes runs past the address space"
        )));
    };
    let mut at = start;
    while at < end {
        let Some((first, last, stretch_end)) = index.locate(at, end) else {
            return Err(PlanError::BlockOutsideBuffers {
                side: Side::Dst,
                block: b,
                addr: start,
                len,
                n_buffers: index.order.len(),
                nearest: format!("byte {at:#x} lies in no item of the decode layout's entries"),
            });
        };
        out.add(first, last)?;
        at = stretch_end;
    }
    Ok(())
}

/// The destination pages per pool and the slots that the blocks in `failed` (ranges of block
/// positions, as engines report failed submissions) of one plan were to write, the plan given
/// by its destination column and lengths, planned into the decode layout `dst`.
///
/// # Errors
/// [`PlanError::FailedBlocks`] for columns of unequal lengths, a range whose start is past its
/// end or that ends past the plan; [`PlanError::BlockOutsideBuffers`] for a failed block whose
/// bytes do not lie in the decode's entries (a plan of another layout);
/// [`PlanError::OutOfMemory`].
pub fn failed_pages(
    dst: &Layout,
    dst_addrs: &[u64],
    lengths: &[u64],
    failed: &[Range<usize>],
) -> Result<FailedPages> {
    check_input(dst_addrs, lengths, failed)?;
    let index = EntryIndex::new(dst)?;
    let mut out = Collect::default();
    for range in failed {
        for b in range.clone() {
            walk_block(&index, b, dst_addrs, lengths, &mut out)?;
        }
    }
    Ok(out.finish())
}

/// Per request of a batch (`summary`, planned from `requests` into the decode layout `dst`),
/// the destination pages per pool and the slots that the blocks in `failed` were to write;
/// requests without any are left out, the rest follow the batch's order. A block of fused
/// requests names each request its own pages (those its destination lists hold).
///
/// # Errors
/// As [`failed_pages`]; [`PlanError::FailedBlocks`] for requests that are not the batch's (of
/// another count).
pub fn failed_batch_pages<S: PageIndex, D: PageIndex>(
    dst: &Layout,
    dst_addrs: &[u64],
    lengths: &[u64],
    summary: &BatchSummary,
    requests: &[Request<'_, S, D>],
    failed: &[Range<usize>],
) -> Result<Vec<RequestFailure>> {
    check_input(dst_addrs, lengths, failed)?;
    if requests.len() != summary.n_requests() {
        return Err(failure_error(format!(
            "{} requests given for a batch of {}; give the requests the batch was planned from",
            requests.len(),
            summary.n_requests()
        )));
    }
    if summary.n_blocks != dst_addrs.len() {
        return Err(failure_error(format!(
            "the batch has {} blocks but its columns have {}",
            summary.n_blocks,
            dst_addrs.len()
        )));
    }
    let index = EntryIndex::new(dst)?;
    let mut found = Vec::new();
    for s in 0..summary.n_segments() {
        let blocks = summary.segment_offsets[s]..summary.segment_offsets[s + 1];
        let mut out = Collect::default();
        let mut any = false;
        for range in failed {
            let (lo, hi) = (range.start.max(blocks.start), range.end.min(blocks.end));
            for b in lo..hi {
                walk_block(&index, b, dst_addrs, lengths, &mut out)?;
                any = true;
            }
        }
        if !any {
            continue;
        }
        let members = summary.segment_requests[s]..summary.segment_requests[s + 1];
        if members.len() == 1 {
            let pages = out.finish();
            if !pages.is_empty() {
                found.push(RequestFailure {
                    request: members.start,
                    pages,
                });
            }
            continue;
        }
        // Fused requests are page requests, and a batch gives each page to one request: each
        // failed page goes to the member whose lists hold it (found by one sorted lookup).
        let owners = page_owners(&requests[members.clone()], members.start)?;
        let mut mine: Vec<Collect> = members.clone().map(|_| Collect::default()).collect();
        for (p, pages) in out.pools.iter().enumerate() {
            for &page in pages {
                let key = (p, page);
                let at = owners.partition_point(|&(pool, pg, _)| (pool, pg) < key);
                if let Some(&(pool, pg, r)) = owners.get(at)
                    && (pool, pg) == key
                {
                    mine[r - members.start].pools[p].push(page);
                }
            }
        }
        for (k, collected) in mine.into_iter().enumerate() {
            let pages = collected.finish();
            if !pages.is_empty() {
                found.push(RequestFailure {
                    request: members.start + k,
                    pages,
                });
            }
        }
    }
    Ok(found)
}

/// Every destination page of `requests` (the first at batch position `first`) as `(pool,
/// page, request)`, sorted.
fn page_owners<S: PageIndex, D: PageIndex>(
    requests: &[Request<'_, S, D>],
    first: usize,
) -> Result<Vec<(usize, i64, usize)>> {
    let n: usize = requests
        .iter()
        .flat_map(dst_lists)
        .map(|list| list.map_or(0, <[D]>::len))
        .sum();
    let mut owners = Vec::new();
    owners
        .try_reserve_exact(n)
        .map_err(|_| PlanError::out_of_memory::<(usize, i64, usize)>("failure verdict", n))?;
    for (k, request) in requests.iter().enumerate() {
        for (p, list) in dst_lists(request).into_iter().enumerate() {
            owners.extend(
                list.into_iter()
                    .flatten()
                    .map(|page| (p, page.get(), first + k)),
            );
        }
    }
    owners.sort_unstable();
    Ok(owners)
}

/// A request's destination page list per pool (`None` where it gives none).
fn dst_lists<'a, S: PageIndex, D: PageIndex>(
    request: &Request<'a, S, D>,
) -> [Option<&'a [D]>; POOLS] {
    let mut lists = [None; POOLS];
    for (p, list) in lists.iter_mut().enumerate() {
        *list = request.pool_pages[p].1;
    }
    if let Indices::Pages { dst, .. } = request.indices {
        lists[PoolId::PAGES.index()] = Some(dst);
    }
    lists
}
