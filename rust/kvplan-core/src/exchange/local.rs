//! Local plans on CPU memory: the buffers of one side as byte slices with their addresses,
//! which buffer holds a block, and [`copy_local`], which executes a local plan (the gather and
//! scatter of a staged or pack plan) between two sets of buffers.
//!
//! Everything is safe Rust over slices: a block is copied only when it lies inside one given
//! buffer on each side, checked for every block before the first byte moves, so a bad plan
//! copies nothing. Callers that make slices from foreign memory (the Python bindings) check
//! with [`check_local_buffers`] first that no destination buffer shares memory with another
//! buffer, which the slices' borrows then state.

use crate::error::{PlanError, Result, Side};

/// One buffer of a side's memory: the address of its first byte and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Region<'a> {
    /// Address of `bytes[0]` in the address space the plan's addresses use.
    pub base: u64,
    /// The buffer's bytes.
    pub bytes: &'a [u8],
}

/// One writable buffer of a side's memory: the address of its first byte and its bytes.
#[derive(Debug)]
pub struct RegionMut<'a> {
    /// Address of `bytes[0]` in the address space the plan's addresses use.
    pub base: u64,
    /// The buffer's bytes.
    pub bytes: &'a mut [u8],
}

/// Finds the buffer holding each block among one side's buffers, given as `(base, size)`
/// (sorted by base once; the last hit is tried first, since consecutive blocks usually come
/// from the same buffer).
pub(crate) struct RegionFinder {
    spans: Vec<(u64, u128)>,
    by_base: Vec<usize>,
    last: usize,
}

impl RegionFinder {
    pub(crate) fn new(spans: impl IntoIterator<Item = (u64, usize)>) -> Self {
        let spans: Vec<(u64, u128)> = spans
            .into_iter()
            .map(|(base, len)| (base, u128::from(base) + len as u128))
            .collect();
        let mut by_base: Vec<usize> = (0..spans.len()).collect();
        by_base.sort_by_key(|&i| spans[i].0);
        Self {
            spans,
            by_base,
            last: 0,
        }
    }

    fn holds(&self, i: usize, addr: u64, len: u64) -> bool {
        let (base, end) = self.spans[i];
        addr >= base && u128::from(addr) + u128::from(len) <= end
    }

    /// The buffer holding `len` bytes at `addr` and the block's offset in it.
    pub(crate) fn find(&mut self, addr: u64, len: u64) -> Option<(usize, usize)> {
        let found = if self.last < self.spans.len() && self.holds(self.last, addr, len) {
            self.last
        } else {
            // The last buffer starting at or before `addr`; with overlapping buffers another
            // one may hold the block, so fall back to trying them all.
            let after = self.by_base.partition_point(|&i| self.spans[i].0 <= addr);
            let candidate = after.checked_sub(1).map(|k| self.by_base[k]);
            candidate
                .filter(|&i| self.holds(i, addr, len))
                .or_else(|| (0..self.spans.len()).find(|&i| self.holds(i, addr, len)))?
        };
        self.last = found;
        // Inside a buffer, so the offset fits in usize (it indexes a slice).
        Some((found, (addr - self.spans[found].0) as usize))
    }

    /// "buffer i at [start, end)" for the buffer nearest to `addr`, for messages.
    fn nearest(&self, addr: u64) -> String {
        let distance = |&(base, end): &(u64, u128)| -> u128 {
            if addr < base {
                u128::from(base - addr)
            } else {
                u128::from(addr).saturating_sub(end)
            }
        };
        (0..self.spans.len())
            .min_by_key(|&i| distance(&self.spans[i]))
            .map_or_else(
                || "no buffers were given".to_string(),
                |i| {
                    let (base, end) = self.spans[i];
                    format!(
                        "nearest is buffer {i} at [{base:#x}, {end:#x}), {} bytes",
                        end - u128::from(base)
                    )
                },
            )
    }

    /// The error for block `block` of `side`, `len` bytes at `addr`, that no buffer holds.
    pub(crate) fn outside(&self, side: Side, block: usize, addr: u64, len: u64) -> PlanError {
        PlanError::BlockOutsideBuffers {
            side,
            block,
            addr,
            len,
            n_buffers: self.spans.len(),
            nearest: self.nearest(addr),
        }
    }
}

/// Checks that no destination buffer shares a byte with another destination buffer, a source
/// buffer or the memory of the plan's own columns (`(base, size)` each; empty spans share
/// nothing). Source buffers may overlap each other and the columns: they are only read.
///
/// # Errors
/// [`PlanError::BuffersOverlap`] naming the first two spans found to overlap.
pub fn check_local_buffers(
    src: &[(u64, u64)],
    dst: &[(u64, u64)],
    columns: &[(u64, u64)],
) -> Result<()> {
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Source,
        Destination,
        Column,
    }
    let end = |(base, size): (u64, u64)| u128::from(base) + u128::from(size);
    let name = |kind: Kind, i: usize, span: (u64, u64)| {
        let what = match kind {
            Kind::Source => format!("source buffer {i}"),
            Kind::Destination => format!("destination buffer {i}"),
            Kind::Column => format!("the plan's column {i}"),
        };
        format!("{what} at [{:#x}, {:#x})", span.0, end(span))
    };
    let listed = |kind: Kind, spans: &[(u64, u64)]| -> Vec<(Kind, usize, (u64, u64))> {
        spans
            .iter()
            .enumerate()
            .map(|(i, &s)| (kind, i, s))
            .collect()
    };
    let mut all: Vec<(Kind, usize, (u64, u64))> = [
        listed(Kind::Source, src),
        listed(Kind::Destination, dst),
        listed(Kind::Column, columns),
    ]
    .concat();
    all.retain(|&(_, _, (_, size))| size > 0);
    all.sort_by_key(|&(_, _, (base, _))| base);
    // Sweep by base: each span is compared with the open spans it starts inside of.
    let mut open: Vec<(Kind, usize, (u64, u64))> = Vec::new();
    for &(kind, i, span) in &all {
        open.retain(|&(_, _, o)| end(o) > u128::from(span.0));
        let clash = open
            .iter()
            .find(|&&(other, _, _)| kind == Kind::Destination || other == Kind::Destination);
        if let Some(&(other, j, other_span)) = clash {
            return Err(PlanError::BuffersOverlap {
                first: name(other, j, other_span),
                second: name(kind, i, span),
            });
        }
        open.push((kind, i, span));
    }
    Ok(())
}

/// Executes a local plan: copies block `k`, `lengths[k]` bytes, from address `src_addrs[k]` in
/// one of `src` to address `dst_addrs[k]` in one of `dst`, in plan order. Every block is
/// located first, so nothing is copied when one lies outside the buffers. Returns the bytes
/// copied.
///
/// # Errors
/// [`PlanError::Geometry`] for columns of unequal lengths; [`PlanError::BlockOutsideBuffers`]
/// naming the first block that does not lie inside one buffer of its side.
pub fn copy_local(
    src_addrs: &[u64],
    dst_addrs: &[u64],
    lengths: &[u64],
    src: &[Region<'_>],
    dst: &mut [RegionMut<'_>],
) -> Result<u64> {
    if src_addrs.len() != lengths.len() || dst_addrs.len() != lengths.len() {
        return Err(PlanError::Geometry {
            what: format!(
                "a plan's columns must have equal lengths, got {} source addresses, {} \
                 destination addresses and {} lengths",
                src_addrs.len(),
                dst_addrs.len(),
                lengths.len()
            ),
        });
    }
    let mut sources = RegionFinder::new(src.iter().map(|r| (r.base, r.bytes.len())));
    let mut targets = RegionFinder::new(dst.iter().map(|r| (r.base, r.bytes.len())));
    let blocks = src_addrs.iter().zip(dst_addrs).zip(lengths);
    let mut total = 0u64;
    for (block, ((&s, &d), &len)) in blocks.clone().enumerate() {
        if sources.find(s, len).is_none() {
            return Err(sources.outside(Side::Src, block, s, len));
        }
        if targets.find(d, len).is_none() {
            return Err(targets.outside(Side::Dst, block, d, len));
        }
        total = total.checked_add(len).ok_or(PlanError::Overflow {
            what: "bytes copied",
        })?;
    }
    for ((&s, &d), &len) in blocks {
        // Found in the pass above (the buffers have not changed since).
        let (Some((i, from)), Some((j, to))) = (sources.find(s, len), targets.find(d, len)) else {
            return Err(PlanError::InputChanged);
        };
        let len = len as usize; // inside a slice
        dst[j].bytes[to..to + len].copy_from_slice(&src[i].bytes[from..from + len]);
    }
    Ok(total)
}
