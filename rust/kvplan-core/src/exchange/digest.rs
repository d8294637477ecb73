//! Integrity digests: what a plan is (the plan digest) and what it moved (the content digest).
//!
//! Both peers can compute the same plan, so the decode can recompute the prefill's plan digest
//! from the two layouts and both page lists and compare it before it trusts any byte, and both
//! sides can hash the bytes the plan moves, each reading its own memory through its own column
//! of the same plan: the prefill its sources, the decode its destinations. The two content
//! digests are equal exactly when every planned byte arrived at its planned place, whatever the
//! relayout between the two sides (TP head slices, PP stages, page sizes, pools, state slots).
//!
//! Every hash is XXH3-64 with seed 0 (the reference `XXH3_64bits` function), and every integer
//! is written little-endian. The exact byte encodings, so that another implementation (a GPU
//! kernel, another language) reproduces the same values:
//!
//! ```text
//! layout fingerprint = XXH3_64(the layout's wire bytes, as Layout::to_bytes writes them)
//!
//! plan digest = XXH3_64(
//!     "KVPLPD" 0x01 0x00                 8 bytes: magic and plan-digest version 1
//!     src fingerprint u64 | dst fingerprint u64
//!     n_pairs u64 | pair_offsets: n_pairs + 1 values, u64 each
//!     n_blocks u64
//!     src_addrs: n_blocks × u64 | dst_addrs: n_blocks × u64 | lengths: n_blocks × u64)
//!
//! chunk hash   = XXH3_64(one chunk's bytes); each block, read at its address on one side, is
//!                cut into chunks of CHUNK_BYTES (65,536) bytes from its start, the last chunk
//!                of a block possibly shorter; a zero-length block has no chunk
//! pair digest  = XXH3_64(the chunk hashes of the pair's blocks, in plan order, u64 each)
//!                (a pair that owns no block hashes the empty input)
//! content digest = XXH3_64(
//!     "KVPLCD" 0x01 0x00                 8 bytes: magic and content-digest version 1
//!     n_pairs u64 | the n_pairs pair digests, u64 each)
//!
//! index digest = XXH3_64("KVPLIX" 0x01 0x00 | n u64 | the n indices, i64 each)
//!
//! delta plan digest = XXH3_64("KVPLDD" 0x01 0x00 | plan digest u64 | skip_tokens u64)
//!                      (a plan of a delta request, whose first skip_tokens tokens do not move;
//!                      a whole request's plan digest is the plan digest itself)
//!
//! leased plan digest = XXH3_64(
//!     "KVPLLD" 0x01 0x00                 8 bytes: magic and leased-digest version 1
//!     plan digest u64 | epoch u64 | request id length u64 | the request id's bytes)
//! ```
//!
//! A lease is what the decode granted when it allocated the pages a plan writes: the request
//! they were allocated for and the epoch of that allocation (a number the decode never hands
//! out twice). The leased plan digest binds a plan to that one allocation, so the decode can
//! tell a writer planned for pages it has since aborted and reused from the current one.
//!
//! A pair's blocks are `pair_offsets[p]..pair_offsets[p + 1]` (a coalesced group's blocks
//! belong to its last pair). Chunks make the content digest parallel: every chunk hash is
//! independent, so a kernel can hash chunks concurrently and combine them in order.
//!
//! The content digest is defined over the plan's blocks, so the two sides must hash the same
//! plan; that is what the plan digest checks first.

use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

use crate::error::{PlanError, Result, Side};
pub use crate::exchange::local::Region;
use crate::exchange::local::RegionFinder;
use crate::peer::layout::Layout;

/// Bytes of one content chunk (the last chunk of a block may be shorter).
pub const CHUNK_BYTES: usize = 1 << 16;
/// Leading bytes of the plan digest's input: magic and version.
pub const PLAN_DIGEST_TAG: [u8; 8] = *b"KVPLPD\x01\x00";
/// Leading bytes of the content digest's input: magic and version.
pub const CONTENT_DIGEST_TAG: [u8; 8] = *b"KVPLCD\x01\x00";
/// Leading bytes of an index list digest's input: magic and version.
pub(crate) const INDEX_DIGEST_TAG: [u8; 8] = *b"KVPLIX\x01\x00";
/// Leading bytes of a delta plan digest's input: magic and version.
pub(crate) const DELTA_DIGEST_TAG: [u8; 8] = *b"KVPLDD\x01\x00";
/// Leading bytes of a leased plan digest's input: magic and version.
pub const LEASE_DIGEST_TAG: [u8; 8] = *b"KVPLLD\x01\x00";

/// The fingerprint of a layout: XXH3-64 of its wire encoding, so two peers agree on it exactly
/// when they agree on every field the handshake carries.
///
/// # Errors
/// [`crate::exchange::wire::encode`]'s errors.
pub fn layout_fingerprint(layout: &Layout) -> Result<u64> {
    Ok(xxh3_64(&crate::exchange::wire::encode(layout)?))
}

/// XXH3-64 of an index list (a request's page list), widened to i64.
pub fn index_digest<P: crate::model::runs::PageIndex>(indices: &[P]) -> u64 {
    let mut hasher = Xxh3Default::new();
    hasher.update(&INDEX_DIGEST_TAG);
    hasher.update(&(indices.len() as u64).to_le_bytes());
    let mut words = Words::new(&mut hasher);
    for &index in indices {
        words.push(index.get() as u64);
    }
    words.flush();
    hasher.digest()
}

/// A plan's blocks and how they divide among its entry pairs.
#[derive(Debug, Clone, Copy)]
pub struct PlanBlocks<'a> {
    /// Source addresses.
    pub src_addrs: &'a [u64],
    /// Destination addresses.
    pub dst_addrs: &'a [u64],
    /// Lengths in bytes.
    pub lengths: &'a [u64],
    /// `n_pairs + 1` increasing block offsets starting at 0 and ending at the block count.
    pub pair_offsets: &'a [usize],
}

impl PlanBlocks<'_> {
    /// Checks the columns and offsets describe one plan.
    ///
    /// # Errors
    /// [`PlanError::DigestInput`] naming the lengths or the offset that is wrong.
    pub fn check(&self) -> Result<()> {
        let n = self.lengths.len();
        if self.src_addrs.len() != n || self.dst_addrs.len() != n {
            return Err(PlanError::DigestInput {
                what: format!(
                    "plan columns of unequal lengths: {} sources, {} destinations, {n} lengths",
                    self.src_addrs.len(),
                    self.dst_addrs.len()
                ),
            });
        }
        let offsets = self.pair_offsets;
        let ok = offsets.first() == Some(&0)
            && offsets.last() == Some(&n)
            && offsets.windows(2).all(|w| w[0] <= w[1]);
        if !ok {
            return Err(PlanError::DigestInput {
                what: format!(
                    "pair offsets must increase from 0 to the block count {n}, got {} offsets \
                     from {:?} to {:?}",
                    offsets.len(),
                    offsets.first(),
                    offsets.last()
                ),
            });
        }
        Ok(())
    }

    /// Entry pairs of the plan.
    pub fn n_pairs(&self) -> usize {
        self.pair_offsets.len().saturating_sub(1)
    }
}

/// Writes u64 values into a hasher through a small buffer (one `update` per 512 values).
struct Words<'h> {
    hasher: &'h mut Xxh3Default,
    buffer: [u8; 4096],
    used: usize,
}

impl<'h> Words<'h> {
    fn new(hasher: &'h mut Xxh3Default) -> Self {
        Self {
            hasher,
            buffer: [0; 4096],
            used: 0,
        }
    }

    #[inline]
    fn push(&mut self, value: u64) {
        if self.used == self.buffer.len() {
            self.flush();
        }
        self.buffer[self.used..self.used + 8].copy_from_slice(&value.to_le_bytes());
        self.used += 8;
    }

    fn extend(&mut self, values: impl IntoIterator<Item = u64>) {
        for value in values {
            self.push(value);
        }
    }

    fn flush(&mut self) {
        self.hasher.update(&self.buffer[..self.used]);
        self.used = 0;
    }
}

/// The plan digest of `blocks` planned between layouts with fingerprints `fingerprints`
/// (source, destination); see the module documentation for the exact encoding.
///
/// # Errors
/// [`PlanBlocks::check`]'s errors.
pub fn plan_digest(fingerprints: (u64, u64), blocks: &PlanBlocks<'_>) -> Result<u64> {
    blocks.check()?;
    let mut hasher = Xxh3Default::new();
    hasher.update(&PLAN_DIGEST_TAG);
    let mut words = Words::new(&mut hasher);
    words.extend([fingerprints.0, fingerprints.1, blocks.n_pairs() as u64]);
    words.extend(blocks.pair_offsets.iter().map(|&o| o as u64));
    words.push(blocks.lengths.len() as u64);
    for column in [blocks.src_addrs, blocks.dst_addrs, blocks.lengths] {
        words.extend(column.iter().copied());
    }
    words.flush();
    Ok(hasher.digest())
}

/// The digest of each entry pair's bytes, read on `side` from `regions` (see the module
/// documentation for the encoding), hashed on the calling thread: on the 2-core development
/// machine, shared with other work, two hashing threads were slower than one (see
/// bench/results/digest-results.md); [`pair_content_digests_on`] spreads the chunks over
/// threads where cores are free.
///
/// # Errors
/// [`PlanBlocks::check`]'s errors; [`PlanError::BlockOutsideBuffers`] naming the first block
/// that does not lie inside one region (nothing outside a region is ever read).
pub fn pair_content_digests(
    blocks: &PlanBlocks<'_>,
    side: Side,
    regions: &[Region<'_>],
) -> Result<Vec<u64>> {
    pair_content_digests_on(blocks, side, regions, 1)
}

/// [`pair_content_digests`] with the chunks hashed on `threads` threads (0 or 1: the calling
/// thread only). Every chunk hash is independent, so the result is the same for any count.
///
/// # Errors
/// As [`pair_content_digests`].
pub fn pair_content_digests_on(
    blocks: &PlanBlocks<'_>,
    side: Side,
    regions: &[Region<'_>],
    threads: usize,
) -> Result<Vec<u64>> {
    blocks.check()?;
    let addrs = side.pick(blocks.src_addrs, blocks.dst_addrs);
    let n = blocks.lengths.len();
    // Every block's bytes first, so the first block outside the buffers is the one named.
    let mut lookup = RegionFinder::new(regions.iter().map(|r| (r.base, r.bytes.len())));
    let mut slices: Vec<&[u8]> = crate::error::try_vec(n, &[][..], "block slices")?;
    // chunk_start[b]: index of block b's first chunk among all chunks of the plan.
    let mut chunk_start = crate::error::try_vec(n + 1, 0usize, "chunk offsets")?;
    for (block, (&addr, &len)) in addrs.iter().zip(blocks.lengths).enumerate() {
        let (i, start) = lookup
            .find(addr, len)
            .ok_or_else(|| lookup.outside(side, block, addr, len))?;
        slices[block] = &regions[i].bytes[start..start + len as usize];
        chunk_start[block + 1] = chunk_start[block] + slices[block].len().div_ceil(CHUNK_BYTES);
    }
    let mut hashes = crate::error::try_vec(chunk_start[n], 0u64, "chunk hashes")?;
    let per_thread = hashes.len().div_ceil(threads.max(1)).max(1);
    if per_thread >= hashes.len() {
        hash_chunks(&slices, &chunk_start, 0, &mut hashes);
    } else {
        std::thread::scope(|scope| {
            for (k, part) in hashes.chunks_mut(per_thread).enumerate() {
                let (slices, chunk_start) = (&slices, &chunk_start);
                scope.spawn(move || hash_chunks(slices, chunk_start, k * per_thread, part));
            }
        });
    }
    let mut digests = crate::error::try_vec(blocks.n_pairs(), 0u64, "pair digests")?;
    for (pair, digest) in digests.iter_mut().enumerate() {
        let mut hasher = Xxh3Default::new();
        let mut words = Words::new(&mut hasher);
        let first = chunk_start[blocks.pair_offsets[pair]];
        let end = chunk_start[blocks.pair_offsets[pair + 1]];
        words.extend(hashes[first..end].iter().copied());
        words.flush();
        *digest = hasher.digest();
    }
    Ok(digests)
}

/// Hashes chunks `first..first + out.len()` of the plan (numbered across all blocks in plan
/// order; `chunk_start` as in [`pair_content_digests_on`]) into `out`.
fn hash_chunks(slices: &[&[u8]], chunk_start: &[usize], first: usize, out: &mut [u64]) {
    if out.is_empty() {
        return;
    }
    // The block holding chunk `first`: the last one starting at or before it (blocks without
    // chunks start where the next one does, so this one has chunks).
    let mut block = chunk_start.partition_point(|&c| c <= first) - 1;
    for (k, hash) in out.iter_mut().enumerate() {
        let chunk = first + k;
        while chunk_start[block + 1] <= chunk {
            block += 1;
        }
        let at = (chunk - chunk_start[block]) * CHUNK_BYTES;
        let bytes = slices[block];
        *hash = chunk_hash(&bytes[at..bytes.len().min(at + CHUNK_BYTES)]);
    }
}

/// The digest of a plan that moves a request's tokens from `skip_tokens` on: the plan digest
/// itself for a whole request (`skip_tokens` 0), else the plan digest and the skip count hashed
/// together, so a decode that re-plans with another skip count disagrees.
pub fn delta_plan_digest(plan_digest: u64, skip_tokens: u64) -> u64 {
    if skip_tokens == 0 {
        return plan_digest;
    }
    let mut input = [0u8; 24];
    input[..8].copy_from_slice(&DELTA_DIGEST_TAG);
    input[8..16].copy_from_slice(&plan_digest.to_le_bytes());
    input[16..].copy_from_slice(&skip_tokens.to_le_bytes());
    xxh3_64(&input)
}

/// The plan digest bound to the destination's lease: the request id the decode allocated the
/// pages for and the epoch of that allocation (see the module documentation for the encoding).
pub fn leased_plan_digest(plan_digest: u64, epoch: u64, request: &[u8]) -> u64 {
    let mut hasher = Xxh3Default::new();
    hasher.update(&LEASE_DIGEST_TAG);
    hasher.update(&plan_digest.to_le_bytes());
    hasher.update(&epoch.to_le_bytes());
    hasher.update(&(request.len() as u64).to_le_bytes());
    hasher.update(request);
    hasher.digest()
}

/// A destination lease as the digests read it: the epoch of the decode's allocation and the
/// request id's bytes (UTF-8 for a text id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRef<'a> {
    /// The epoch the decode allocated the pages in.
    pub epoch: u64,
    /// The request id the pages were allocated for.
    pub request: &'a [u8],
}

/// The digest a request's plan is verified by: its plan digest bound to its skip count
/// ([`delta_plan_digest`]), then to its lease when it has one ([`leased_plan_digest`]). The one
/// rule for a plan planned alone and for every request of a batch plan, so a decode that
/// verifies a batch's requests one by one recomputes exactly what the prefill's batch carried.
pub fn request_plan_digest(plan_digest: u64, skip_tokens: u64, lease: Option<LeaseRef<'_>>) -> u64 {
    let digest = delta_plan_digest(plan_digest, skip_tokens);
    match lease {
        Some(lease) => leased_plan_digest(digest, lease.epoch, lease.request),
        None => digest,
    }
}

/// The content digest of a plan from its pair digests (see the module documentation).
pub fn content_digest(pair_digests: &[u64]) -> u64 {
    let mut hasher = Xxh3Default::new();
    hasher.update(&CONTENT_DIGEST_TAG);
    let mut words = Words::new(&mut hasher);
    words.push(pair_digests.len() as u64);
    words.extend(pair_digests.iter().copied());
    words.flush();
    hasher.digest()
}

/// XXH3-64 of one content chunk, through an implementation that picks its SIMD path (AVX2,
/// SSE2, NEON) when it runs, not when it is compiled: a portable build still gets AVX2.
#[inline]
fn chunk_hash(chunk: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(chunk)
}
