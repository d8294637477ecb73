//! Staged plans in rounds: a request's staged plan ([`crate::planners::staged`]) cut into
//! rounds that each fit one buffer of a bounded arena, so the staging memory a request needs is
//! the arena whatever the request's size.
//!
//! Each side has one *arena* `(addr, size)` split into `buffers` round buffers (two for double
//! buffering). Round `k` uses buffer `k % buffers` on both sides:
//! - `gather`: the round's bytes from prefill memory into its prefill round buffer, back to
//!   back from the buffer's start;
//! - `network`: one block, the prefill round buffer → the decode round buffer of the same
//!   number (the round's bytes lie back to back in both, so one block always suffices);
//! - `scatter`: from the decode round buffer into the decode's pages.
//!
//! How rounds derive from the staged plan: its gather writes the request's bytes back to back
//! into the prefill staging region in plan order, and its scatter reads them in the same order
//! (range after range, each range's blocks in order), so each byte has one *stream offset*
//! (its offset in the prefill staging region) in both. A round is a stream interval `[a, c)`;
//! its gather and scatter are the staged gather and scatter blocks clipped to that interval,
//! with the staging offset `s` replaced by `buffer start + (s − a)` on each side. No address
//! is computed anew: every prefill and decode address is the staged plan's. Where the staged
//! scatter reads its decode staging offsets is checked against the staged network (each
//! scatter block must read, through the network block holding its stream interval, what the
//! gather wrote there); a mismatch refuses the plan ([`PlanError::InputChanged`]).
//!
//! Where rounds are cut: at most `buffer_bytes` per round, at the last point where a gather
//! block and a scatter block both end when that fills at least half the buffer, else at the
//! last point where either ends; a stream offset inside a block only when no block ends in the
//! buffer (a block larger than the buffer, split at a byte boundary: every stage is a byte
//! copy, so the bytes land where the direct plan puts them whatever the cut). Templates whose
//! sides hold different representations are planned by `ConversionTemplate`, not here, so no
//! conversion row ever reaches a round.
//!
//! Several senders into one decode arena: the prefill ranks that fill one decode rank's
//! staging region (the staged plan's writers, [`crate::rules::heads::staging_writer`]) and,
//! under prefill PP, every stage, send rounds at the same time. Each *sender* therefore owns
//! its own share of the decode arena: sender `i = writer × pp_size + pp_rank` of `senders =
//! writers × pp_size` owns bytes `[i × share, (i + 1) × share)` with `share = size /
//! senders`, and its buffer `b` is `share / buffers` bytes at `i × share + b × (share /
//! buffers)`. The prefill arena belongs to one rank: buffer `b` is at `b × (size /
//! buffers)`. A round holds at most `buffer_bytes = min(prefill size / buffers, decode share /
//! buffers)` bytes.
//!
//! A [`RoundManifest`] per round (a fixed 64-byte wire form) says which round it is of how
//! many, its stream interval and where its bytes land in the decode arena, so a decode can
//! check each arrival and fail a request at the first round that does not match.
//!
//! Refused before any output exists, naming the values: zero buffers, an arena size that is
//! not a multiple of its buffers (times the senders on the decode), a round buffer of no bytes
//! ([`PlanError::StagingTooSmall`]), an arena whose end overflows; and whatever the staged plan
//! refuses (with `plan_rounds` named in an [`PlanError::Unsupported`]).

use crate::error::{PlanError, Result};
use crate::model::layer_groups::PeerRanks;
use crate::model::plan::{FlatBuffer, Plan};
use crate::model::request::Request;
use crate::model::runs::PageIndex;
use crate::peer_pair::template::Template;
use crate::planners::pack::PackBuffer;
use crate::planners::staged::{StagedPlanner, StagingRegion};
use crate::rules::capabilities::Planner;
use crate::rules::heads::staging_writer;

/// One side's bounded staging memory: `(addr, size)`, split into round buffers.
pub type Arena = PackBuffer;

/// Round buffers per arena when the caller does not say: two, so one round's network can run
/// while the next round's gather fills the other buffer.
pub const DEFAULT_BUFFERS: u32 = 2;

/// What a decode is told about one round: enough to check that an arrival is the round it
/// expects and where its bytes lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoundManifest {
    /// The round's position, from 0.
    pub index: u32,
    /// Rounds of the request (this sender's).
    pub n_rounds: u32,
    /// The round buffer it uses (`index % buffers`).
    pub buffer: u32,
    /// Network blocks the round sends (one, or none for an empty request).
    pub n_network_blocks: u32,
    /// `(sender index, number of senders)` into the decode arena.
    pub sender: (u32, u32),
    /// Bytes of the request before this round (its stream offset).
    pub offset: u64,
    /// Bytes the round moves.
    pub bytes: u64,
    /// Bytes of the whole request (this sender's).
    pub total_bytes: u64,
    /// Offset in the decode arena where the round's bytes start; they end `bytes` later.
    pub dst_offset: u64,
}

/// The magic that starts a manifest's wire form.
const MANIFEST_MAGIC: [u8; 4] = *b"KVRM";
/// The wire form's version.
const MANIFEST_VERSION: u16 = 1;

impl RoundManifest {
    /// Bytes of the wire form.
    pub const WIRE_BYTES: usize = 64;

    /// Offsets `[start, end)` of the decode arena the round's bytes land in.
    pub fn dst_bytes_range(&self) -> (u64, u64) {
        (self.dst_offset, self.dst_offset.saturating_add(self.bytes))
    }

    /// Whether this is the request's last round.
    pub fn is_last(&self) -> bool {
        self.index.saturating_add(1) == self.n_rounds
    }

    /// The fixed wire form: `KVRM`, version (u16), 2 zero bytes, then `index`, `n_rounds`,
    /// `buffer`, `n_network_blocks`, sender index, senders (u32 each), `offset`, `bytes`,
    /// `total_bytes`, `dst_offset` (u64 each), all little-endian.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_BYTES] {
        let mut out = [0u8; Self::WIRE_BYTES];
        out[..4].copy_from_slice(&MANIFEST_MAGIC);
        out[4..6].copy_from_slice(&MANIFEST_VERSION.to_le_bytes());
        let words = [
            self.index,
            self.n_rounds,
            self.buffer,
            self.n_network_blocks,
            self.sender.0,
            self.sender.1,
        ];
        for (i, w) in words.into_iter().enumerate() {
            out[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        let longs = [self.offset, self.bytes, self.total_bytes, self.dst_offset];
        for (i, w) in longs.into_iter().enumerate() {
            out[32 + 8 * i..40 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Reads [`RoundManifest::to_bytes`]'s form back, checking that it is one.
    ///
    /// # Errors
    /// [`PlanError::Wire`] for a wrong length, magic or version, or values that no round has
    /// (an index at or past the rounds, a sender at or past the senders, bytes past the
    /// request's end).
    pub fn from_bytes(data: &[u8]) -> Result<Self> {
        let wire = |what: String| PlanError::Wire { what };
        if data.len() != Self::WIRE_BYTES {
            return Err(wire(format!(
                "a round manifest is {} bytes, got {}",
                Self::WIRE_BYTES,
                data.len()
            )));
        }
        if data[..4] != MANIFEST_MAGIC {
            return Err(wire(format!(
                "a round manifest starts with b\"KVRM\", got {:?}",
                &data[..4]
            )));
        }
        let version = u16::from_le_bytes([data[4], data[5]]);
        if version != MANIFEST_VERSION {
            return Err(wire(format!(
                "round manifest version {version}, this kvplan reads version \
                 {MANIFEST_VERSION}"
            )));
        }
        let word = |i: usize| {
            let at = 8 + 4 * i;
            u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]])
        };
        let long = |i: usize| {
            let at = 32 + 8 * i;
            let mut b = [0u8; 8];
            b.copy_from_slice(&data[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let manifest = Self {
            index: word(0),
            n_rounds: word(1),
            buffer: word(2),
            n_network_blocks: word(3),
            sender: (word(4), word(5)),
            offset: long(0),
            bytes: long(1),
            total_bytes: long(2),
            dst_offset: long(3),
        };
        manifest.check().map_err(wire)?;
        Ok(manifest)
    }

    /// Why these values are no round's, if they are not.
    fn check(&self) -> std::result::Result<(), String> {
        if self.index >= self.n_rounds {
            return Err(format!(
                "round index {} is not below the request's {} rounds",
                self.index, self.n_rounds
            ));
        }
        if self.sender.0 >= self.sender.1 {
            return Err(format!(
                "sender {} is not below the {} senders",
                self.sender.0, self.sender.1
            ));
        }
        match self.offset.checked_add(self.bytes) {
            Some(end) if end <= self.total_bytes => {}
            _ => {
                return Err(format!(
                    "round bytes [{}, {}+{}) reach past the request's {} bytes",
                    self.offset, self.offset, self.bytes, self.total_bytes
                ));
            }
        }
        if self.dst_offset.checked_add(self.bytes).is_none() {
            return Err(format!(
                "decode offset {} + {} bytes overflows",
                self.dst_offset, self.bytes
            ));
        }
        Ok(())
    }
}

/// The blocks of one stage for every round, round after round in one set of columns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoundBlocks {
    /// The columns: sources, destinations and lengths, `capacity` values apart; the first
    /// `n_blocks` of each are the blocks.
    pub buffer: FlatBuffer,
    /// Blocks written.
    pub n_blocks: usize,
    /// `n_rounds + 1` block offsets: round `k`'s blocks are `round_offsets[k]..
    /// round_offsets[k + 1]`.
    pub round_offsets: Vec<usize>,
}

impl RoundBlocks {
    fn column(&self, k: usize) -> &[u64] {
        let at = k * self.buffer.capacity;
        &self.buffer.data[at..at + self.n_blocks]
    }

    /// Source addresses of every round's blocks.
    pub fn src_addrs(&self) -> &[u64] {
        self.column(0)
    }

    /// Destination addresses of every round's blocks.
    pub fn dst_addrs(&self) -> &[u64] {
        self.column(1)
    }

    /// Lengths of every round's blocks.
    pub fn lengths(&self) -> &[u64] {
        self.column(2)
    }

    /// Round `k`'s blocks as an owned plan (one pair range of all its blocks).
    ///
    /// # Panics
    /// When `k` is not below the number of rounds.
    pub fn round(&self, k: usize) -> Plan {
        let (a, b) = (self.round_offsets[k], self.round_offsets[k + 1]);
        let lengths = self.lengths()[a..b].to_vec();
        Plan {
            src_addrs: self.src_addrs()[a..b].to_vec(),
            dst_addrs: self.dst_addrs()[a..b].to_vec(),
            n_runs: b - a,
            total_bytes: lengths.iter().sum(),
            lengths,
            pair_offsets: vec![0, b - a],
        }
    }

    /// Writes one block; the caller sized the buffer for every block it writes.
    fn push(&mut self, (s, d, l): (u64, u64, u64)) {
        let (n, cap) = (self.n_blocks, self.buffer.capacity);
        self.buffer.data[n] = s;
        self.buffer.data[cap + n] = d;
        self.buffer.data[2 * cap + n] = l;
        self.n_blocks += 1;
    }

    fn end_round(&mut self) {
        self.round_offsets.push(self.n_blocks);
    }
}

/// A request's staged plan in rounds (see the [`crate::planners::rounds`] module).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StagedRounds {
    /// Prefill memory → prefill round buffers, per round.
    pub gather: RoundBlocks,
    /// Prefill round buffer → decode round buffer, per round.
    pub network: RoundBlocks,
    /// Decode round buffers → decode memory, per round.
    pub scatter: RoundBlocks,
    /// One manifest per round.
    pub manifests: Vec<RoundManifest>,
    /// Round buffers per arena.
    pub buffers: u32,
    /// The most bytes one round holds (the smaller of the two sides' round buffers).
    pub buffer_bytes: u64,
    /// Bytes of the request (this sender's).
    pub bytes: u64,
    /// Blocks of the request's direct plan.
    pub direct_blocks: usize,
    /// Blocks of the unchunked staged plan's network.
    pub staged_network_blocks: usize,
    /// `(sender index, number of senders)` into the decode arena.
    pub sender: (u32, u32),
    /// Offsets `[start, end)` of the decode arena this sender's share covers.
    pub dst_share: (u64, u64),
}

impl StagedRounds {
    /// Rounds planned.
    pub fn len(&self) -> usize {
        self.manifests.len()
    }

    /// Whether no round is planned (a request of no bytes).
    pub fn is_empty(&self) -> bool {
        self.manifests.is_empty()
    }
}

/// Plans staged rounds of one template; borrows the template.
#[derive(Debug, Clone)]
pub struct RoundsPlanner<'t> {
    template: &'t Template,
}

/// Where the rounds of one sender go: its round buffers on both sides.
#[derive(Debug, Clone, Copy)]
struct RoundGeometry {
    src_arena: Arena,
    dst_arena: Arena,
    buffers: u32,
    src_buffer: u64,
    dst_buffer: u64,
    /// Offset of this sender's share in the decode arena.
    dst_share: u64,
    buffer_bytes: u64,
    sender: (u32, u32),
    /// `(writer index, writers)` of the staged plan's decode region.
    writer: (u32, u32),
}

impl RoundGeometry {
    fn src_buffer_addr(&self, buffer: u32) -> u64 {
        self.src_arena.addr + u64::from(buffer) * self.src_buffer
    }

    fn dst_buffer_offset(&self, buffer: u32) -> u64 {
        self.dst_share + u64::from(buffer) * self.dst_buffer
    }
}

/// One staged stage's blocks, in stream order.
struct StreamBlocks<'a> {
    src: &'a [u64],
    dst: &'a [u64],
    len: &'a [u64],
}

impl<'a> StreamBlocks<'a> {
    /// The first `n` blocks of `buf`.
    fn of(buf: &'a FlatBuffer, n: usize) -> Self {
        let c = buf.capacity;
        Self {
            src: &buf.data[..n],
            dst: &buf.data[c..c + n],
            len: &buf.data[2 * c..2 * c + n],
        }
    }
}

impl<'t> RoundsPlanner<'t> {
    /// The rounds planner of `template`.
    pub fn new(template: &'t Template) -> Self {
        Self { template }
    }

    /// Allocating convenience over [`RoundsPlanner::plan_with`].
    ///
    /// # Errors
    /// As [`RoundsPlanner::plan_with`].
    pub fn plan<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        src_arena: Arena,
        dst_arena: Arena,
        buffers: u32,
    ) -> Result<StagedRounds> {
        self.plan_with(
            request,
            (src_arena, dst_arena),
            buffers,
            FlatBuffer::try_zeroed,
            drop,
        )
    }

    /// Plans one request (as [`Template::plan_into`]) as rounds through `src_arena` (prefill
    /// memory) and `dst_arena` (decode memory) with `buffers` round buffers per arena; see the
    /// [`crate::planners::rounds`] module. `alloc(n)` lends every output and scratch buffer
    /// of `n` values per column; `give_back` receives the two scratch buffers the staged plan
    /// was written into once the rounds are cut from it.
    ///
    /// # Errors
    /// [`PlanError::Unsupported`] naming `plan_rounds` for what a staged plan refuses;
    /// [`PlanError::Geometry`] for zero buffers or an arena size that is not a multiple of
    /// its buffers (times the senders on the decode); [`PlanError::StagingTooSmall`] when a
    /// round buffer holds no byte; [`PlanError::Overflow`] for an arena whose end overflows;
    /// as [`StagedPlanner::plan_into`] otherwise.
    pub fn plan_with<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        (src_arena, dst_arena): (Arena, Arena),
        buffers: u32,
        mut alloc: impl FnMut(usize) -> Result<FlatBuffer>,
        mut give_back: impl FnMut(FlatBuffer),
    ) -> Result<StagedRounds> {
        self.template.admit(Planner::Rounds, request)?;
        let geometry = self.geometry(src_arena, dst_arena, buffers)?;
        // The staged plan over regions spanning the address space from 0: its gather's
        // destinations and network's sources are then stream offsets themselves, and its
        // scatter's sources decode staging offsets.
        let whole = StagingRegion {
            addr: 0,
            size: u64::MAX,
        };
        let (gather_buf, scatter_buf, staged) =
            StagedPlanner::new(self.template).plan_into(request, whole, whole, |shape| {
                Ok((alloc(shape.n_blocks)?, alloc(shape.n_blocks)?))
            })?;
        let result = (|| {
            // The staged plan places this rank as the writer the arena shares were cut for.
            if staged.writer != geometry.writer {
                return Err(PlanError::InputChanged);
            }
            let gather = StreamBlocks::of(&gather_buf, staged.gather.n_blocks);
            let scatter = StreamBlocks::of(&scatter_buf, staged.scatter.n_blocks);
            let total = staged.src_staging_bytes;
            check_stream(&gather, &scatter, &staged.network, total)?;
            let cuts = cut_rounds(gather.len, scatter.len, total, geometry.buffer_bytes);
            let mut rounds = emit_rounds(&gather, &scatter, &cuts, &geometry, &mut alloc)?;
            rounds.bytes = total;
            rounds.direct_blocks = staged.direct_blocks;
            rounds.staged_network_blocks = staged.network.lengths.len();
            Ok(rounds)
        })();
        give_back(gather_buf);
        give_back(scatter_buf);
        result
    }

    /// `(sender index, senders)` of this template's prefill rank into the decode arena.
    fn senders(&self) -> Result<((u32, u32), (u32, u32))> {
        let prefill = PeerRanks::of(&self.template.layouts.0);
        let decode = PeerRanks::of(&self.template.layouts.1);
        let (writer, writers) = staging_writer(prefill.tp_size, prefill.tp_rank, decode.tp_size)?;
        let pp = prefill.pp_size.max(1);
        let overflow = || PlanError::Overflow {
            what: "decode arena senders",
        };
        let senders = writers.checked_mul(pp).ok_or_else(overflow)?;
        let index = writer
            .checked_mul(pp)
            .and_then(|w| w.checked_add(prefill.pp_rank.min(pp - 1)))
            .ok_or_else(overflow)?;
        Ok(((index, senders), (writer, writers)))
    }

    /// Checks the arenas and `buffers` and places this sender's round buffers.
    fn geometry(&self, src_arena: Arena, dst_arena: Arena, buffers: u32) -> Result<RoundGeometry> {
        if buffers == 0 {
            return Err(PlanError::Geometry {
                what: "plan_rounds needs at least one round buffer per arena, got buffers=0"
                    .to_string(),
            });
        }
        for (arena, what) in [
            (src_arena, "prefill arena end"),
            (dst_arena, "decode arena end"),
        ] {
            arena
                .addr
                .checked_add(arena.size)
                .ok_or(PlanError::Overflow { what })?;
        }
        let ((index, senders), writer) = self.senders()?;
        if !src_arena.size.is_multiple_of(u64::from(buffers)) {
            return Err(PlanError::Geometry {
                what: format!(
                    "the prefill arena's {} bytes do not split into {buffers} equal round \
                     buffers; give a size that is a multiple of {buffers}",
                    src_arena.size
                ),
            });
        }
        let per_dst = u64::from(buffers) * u64::from(senders);
        if !dst_arena.size.is_multiple_of(per_dst) {
            return Err(PlanError::Geometry {
                what: format!(
                    "the decode arena's {} bytes do not split into {senders} sender share(s) \
                     × {buffers} equal round buffers; give a size that is a multiple of \
                     {per_dst}",
                    dst_arena.size
                ),
            });
        }
        let src_buffer = src_arena.size / u64::from(buffers);
        let dst_buffer = dst_arena.size / per_dst;
        let buffer_bytes = src_buffer.min(dst_buffer);
        if buffer_bytes == 0 {
            let (region, have, layout) = if src_buffer == 0 {
                (
                    "prefill round buffer",
                    src_arena.size,
                    format!("{buffers} round buffers of at least one byte"),
                )
            } else {
                (
                    "decode round buffer",
                    dst_arena.size,
                    format!(
                        "{senders} sender share(s) × {buffers} round buffers of at least one \
                         byte"
                    ),
                )
            };
            return Err(PlanError::StagingTooSmall {
                region,
                need: if src_buffer == 0 {
                    u64::from(buffers)
                } else {
                    per_dst
                },
                have,
                layout,
            });
        }
        Ok(RoundGeometry {
            src_arena,
            dst_arena,
            buffers,
            src_buffer,
            dst_buffer,
            dst_share: u64::from(index) * u64::from(buffers) * dst_buffer,
            buffer_bytes,
            sender: (index, senders),
            writer,
        })
    }
}

/// Checks what the rounds rely on: the staged gather writes stream offsets `0..total` back to
/// back, and each staged scatter block (at the stream offset its predecessors' lengths add up
/// to) reads the decode staging offset the network block holding that stream interval wrote.
///
/// # Errors
/// [`PlanError::InputChanged`] when either does not hold.
fn check_stream(
    gather: &StreamBlocks<'_>,
    scatter: &StreamBlocks<'_>,
    network: &Plan,
    total: u64,
) -> Result<()> {
    let mut at = 0u64;
    for (&d, &l) in gather.dst.iter().zip(gather.len) {
        if d != at {
            return Err(PlanError::InputChanged);
        }
        at = at.checked_add(l).ok_or(PlanError::InputChanged)?;
    }
    if at != total {
        return Err(PlanError::InputChanged);
    }
    let mut j = 0usize;
    let mut at = 0u64;
    for (&s, &l) in scatter.src.iter().zip(scatter.len) {
        // The network block holding stream offset `at` (network sources are stream offsets).
        while j < network.lengths.len() && network.src_addrs[j] + network.lengths[j] <= at {
            j += 1;
        }
        let fits = j < network.lengths.len() && {
            let (ns, nd, nl) = (
                network.src_addrs[j],
                network.dst_addrs[j],
                network.lengths[j],
            );
            ns <= at && at + l <= ns + nl && s == nd + (at - ns)
        };
        if !fits && l > 0 {
            return Err(PlanError::InputChanged);
        }
        at = at.checked_add(l).ok_or(PlanError::InputChanged)?;
    }
    if at != total {
        return Err(PlanError::InputChanged);
    }
    Ok(())
}

/// The end of every round's stream interval (see the module documentation for where rounds
/// are cut). Each is above the previous one and at most `buffer_bytes` after it; the last is
/// `total`.
fn cut_rounds(gather: &[u64], scatter: &[u64], total: u64, buffer_bytes: u64) -> Vec<u64> {
    let mut cuts = Vec::with_capacity(usize::try_from(total / buffer_bytes + 1).unwrap_or(0));
    // Per stage: the index of the first block ending after the round's start, and its end.
    let (mut gi, mut g_end) = (0usize, gather.first().copied().unwrap_or(total));
    let (mut si, mut s_end) = (0usize, scatter.first().copied().unwrap_or(total));
    let mut start = 0u64;
    while start < total {
        let limit = start.saturating_add(buffer_bytes).min(total);
        let cut = if limit == total {
            total
        } else {
            let (mut gj, mut ge, mut sj, mut se) = (gi, g_end, si, s_end);
            let (mut common, mut any) = (None, None);
            while ge <= limit || se <= limit {
                let end = ge.min(se);
                if end > start {
                    if ge == se {
                        common = Some(end);
                    }
                    any = Some(end);
                }
                if ge == end {
                    gj += 1;
                    ge = gather.get(gj).map_or(total, |l| ge + l);
                }
                if se == end {
                    sj += 1;
                    se = scatter.get(sj).map_or(total, |l| se + l);
                }
                if end == total {
                    break;
                }
            }
            match (common, any) {
                (Some(c), _) if c - start >= buffer_bytes.div_ceil(2) => c,
                (_, Some(a)) if a > start => a,
                _ => limit,
            }
        };
        cuts.push(cut);
        while g_end <= cut && gi < gather.len() {
            gi += 1;
            g_end = gather.get(gi).map_or(total, |l| g_end + l);
        }
        while s_end <= cut && si < scatter.len() {
            si += 1;
            s_end = scatter.get(si).map_or(total, |l| s_end + l);
        }
        start = cut;
    }
    cuts
}

/// Emits every round's gather, network and scatter and its manifest.
fn emit_rounds(
    gather: &StreamBlocks<'_>,
    scatter: &StreamBlocks<'_>,
    cuts: &[u64],
    geometry: &RoundGeometry,
    alloc: &mut impl FnMut(usize) -> Result<FlatBuffer>,
) -> Result<StagedRounds> {
    let n_rounds = u32::try_from(cuts.len()).map_err(|_| PlanError::Overflow {
        what: "the number of rounds",
    })?;
    let mut blocks = |n: usize| -> Result<RoundBlocks> {
        // Each cut splits at most one block of a stage.
        let mut round_offsets = Vec::with_capacity(cuts.len() + 1);
        round_offsets.push(0);
        Ok(RoundBlocks {
            buffer: alloc(n.saturating_add(cuts.len()))?,
            n_blocks: 0,
            round_offsets,
        })
    };
    let mut out = StagedRounds {
        gather: blocks(gather.len.len())?,
        scatter: blocks(scatter.len.len())?,
        network: blocks(0)?,
        manifests: Vec::with_capacity(cuts.len()),
        buffers: geometry.buffers,
        buffer_bytes: geometry.buffer_bytes,
        sender: geometry.sender,
        dst_share: (
            geometry.dst_share,
            geometry.dst_share + u64::from(geometry.buffers) * geometry.dst_buffer,
        ),
        ..StagedRounds::default()
    };
    let total = cuts.last().copied().unwrap_or(0);
    // Per stage: the next block and its stream offset.
    let (mut gk, mut g_at) = (0usize, 0u64);
    let (mut sk, mut s_at) = (0usize, 0u64);
    let mut start = 0u64;
    for (k, &cut) in cuts.iter().enumerate() {
        let buffer = (k as u64 % u64::from(geometry.buffers)) as u32;
        let src_base = geometry.src_buffer_addr(buffer);
        let dst_offset = geometry.dst_buffer_offset(buffer);
        let dst_base = geometry.dst_arena.addr + dst_offset;
        // Gather: prefill address → the round's prefill buffer.
        while gk < gather.len.len() && g_at < cut {
            let (s, l) = (gather.src[gk], gather.len[gk]);
            let (lo, hi) = (g_at.max(start), (g_at + l).min(cut));
            if hi > lo {
                out.gather
                    .push((s + (lo - g_at), src_base + (lo - start), hi - lo));
            }
            if g_at + l > cut {
                break;
            }
            g_at += l;
            gk += 1;
        }
        // Scatter: the round's decode buffer → decode address.
        while sk < scatter.len.len() && s_at < cut {
            let (d, l) = (scatter.dst[sk], scatter.len[sk]);
            let (lo, hi) = (s_at.max(start), (s_at + l).min(cut));
            if hi > lo {
                out.scatter
                    .push((dst_base + (lo - start), d + (lo - s_at), hi - lo));
            }
            if s_at + l > cut {
                break;
            }
            s_at += l;
            sk += 1;
        }
        let bytes = cut - start;
        out.network.push((src_base, dst_base, bytes));
        out.gather.end_round();
        out.scatter.end_round();
        out.network.end_round();
        out.manifests.push(RoundManifest {
            index: k as u32,
            n_rounds,
            buffer,
            n_network_blocks: 1,
            sender: geometry.sender,
            offset: start,
            bytes,
            total_bytes: total,
            dst_offset,
        });
        start = cut;
    }
    Ok(out)
}
