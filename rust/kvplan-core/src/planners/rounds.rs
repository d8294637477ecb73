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
//! is computed anew: every prefill and decode address is the staged plan's. The staged
//! gather's staging offsets are checked to be the stream offsets (a mismatch refuses the plan,
//! [`PlanError::InputChanged`]); the scatter's sources are written from each block's stream
//! offset as the staged planner emits it, never from its decode staging offsets.
//!
//! Where rounds are cut: a request of `total` bytes always takes the fewest rounds its round
//! buffer allows, `ceil(total / buffer_bytes)`. First each round is cut at the last point
//! within the buffer where a block of the *major* stage ends (the gather or the scatter,
//! whichever has more blocks): the major stage is then written once in the output the staged
//! plan is emitted into (only its staging column differs; the scatter cut while it is emitted,
//! so planning rounds walks it once, the gather rewritten in place after), and only the minor
//! stage, with at most one block split per cut, is copied out. Where those cuts would take more
//! rounds than the fewest (blocks that do not tile the buffer: a round would end up to a block
//! short of full, and each round is a network read and its messages), or a block is larger
//! than the buffer, every round but the last is cut where its buffer ends instead, splitting at
//! most one block of each stage per cut at a byte boundary: every stage is a byte copy, so the
//! bytes land where the direct plan puts them whatever the cut. Templates whose sides hold
//! different representations are planned by `ConversionTemplate`, not here, so no conversion
//! row ever reaches a round.
//!
//! Several senders into one decode arena: the prefill TP ranks that move this decode rank's
//! bytes ([`crate::rules::heads::arena_sender`]: those the template's head slicing sends KV
//! heads from, one elected holder per replicated head unless the template was built with
//! `replicas_send`, then each of the staged plan's writers; when the layouts publish no
//! attention geometry, one prefill rank per decode rank, `floor(r_d · tp_p / tp_d)`, or with
//! `replicas_send` every writer) and, under prefill PP, every stage, send rounds at the same
//! time. Each *sender* therefore owns its own share of the decode arena: sender `i = position
//! × pp_size + pp_rank` of `senders = tp_senders × pp_size` owns bytes `[i × share, (i + 1) ×
//! share)` with `share = size / senders`, and its buffer `b` is `share / buffers` bytes at `i ×
//! share + b × (share / buffers)`. A prefill rank that moves nothing to the decode rank owns
//! no share: its rounds are empty, its sender index 0 and its `dst_share` empty (one that
//! moves whole items but is not the decode rank's sender is refused, naming the sender, and so
//! is one that moves only state slots: a hybrid request's state pairs are more ranges of the
//! stream, but a share is a KV sender's; `replicas_send` gives every writer one). The prefill
//! arena belongs to one rank: buffer `b` is at `b × (size / buffers)`. A round holds at most
//! `buffer_bytes = min(prefill size / buffers, decode share / buffers)` bytes.
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
use crate::planners::staged::{ScatterSources, StagedPlanner, StagingRegion};
use crate::rules::capabilities::Planner;
use crate::rules::heads::{arena_sender, staging_writer};

/// One side's bounded staging memory: `(addr, size)`, split into round buffers.
pub type Arena = PackBuffer;

/// Round buffers per arena when the caller does not say: two, so one round's network can run
/// while the next round's gather fills the other buffer.
pub const DEFAULT_BUFFERS: u32 = 2;

/// Appends `value`, growing `list` (amortised) with an error naming `what` when memory runs
/// out: the number of rounds grows with the request over the round buffer, so a tiny buffer
/// on a huge request asks for much memory and must fail as an error, never abort.
fn try_push<T>(list: &mut Vec<T>, value: T, what: &'static str) -> Result<()> {
    if list.len() == list.capacity() {
        list.try_reserve(1)
            .map_err(|_| PlanError::out_of_memory::<T>(what, list.len().saturating_add(1)))?;
    }
    list.push(value);
    Ok(())
}

/// An empty list with room for `n` values, or an error naming `what`.
fn reserved<T>(n: usize, what: &'static str) -> Result<Vec<T>> {
    let mut list = Vec::new();
    list.try_reserve_exact(n)
        .map_err(|_| PlanError::out_of_memory::<T>(what, n))?;
    Ok(list)
}

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

    fn end_round(&mut self) -> Result<()> {
        try_push(&mut self.round_offsets, self.n_blocks, "round offsets")
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
    /// Whether this prefill rank sends the decode rank anything (else it owns no share).
    owns_share: bool,
    /// `(writer index, writers)` of the staged plan's decode region.
    writer: (u32, u32),
}

impl RoundGeometry {
    /// Where the prefill round buffers start.
    fn src_bases(&self) -> Bases {
        Bases {
            first: self.src_arena.addr,
            stride: self.src_buffer,
            buffers: self.buffers,
        }
    }

    /// Where this sender's decode round buffers start.
    fn dst_bases(&self) -> Bases {
        Bases {
            first: self.dst_arena.addr + self.dst_share,
            stride: self.dst_buffer,
            buffers: self.buffers,
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
    /// its buffers (times the senders on the decode), or for a prefill rank that moves whole
    /// items (no attention geometry) to a decode rank another prefill rank sends them
    /// ([`crate::rules::heads::arena_sender`]); [`PlanError::StagingTooSmall`] when a round
    /// buffer holds no byte; [`PlanError::Overflow`] for an arena whose end overflows; as
    /// [`StagedPlanner::plan_into`] otherwise.
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
        let mut cutter = ScatterCutter::new(geometry.dst_bases(), geometry.buffer_bytes);
        let (gather_buf, scatter_buf, staged) = StagedPlanner::new(self.template).plan_into_with(
            request,
            (whole, whole),
            |shape| Ok((alloc(shape.n_blocks)?, alloc(shape.n_blocks)?)),
            &mut cutter,
        )?;
        // The staged plan places this rank as the writer the arena shares were cut for.
        if staged.writer != geometry.writer {
            give_back(gather_buf);
            give_back(scatter_buf);
            return Err(PlanError::InputChanged);
        }
        let total = staged.src_staging_bytes;
        if total > 0 && !geometry.owns_share {
            give_back(gather_buf);
            give_back(scatter_buf);
            let prefill = PeerRanks::of(&self.template.layouts.0);
            let decode = PeerRanks::of(&self.template.layouts.1);
            let tp = u64::from(prefill.tp_size) / u64::from(decode.tp_size.max(1));
            let sender = u64::from(decode.tp_rank) * tp;
            if self.template.head_slicing().is_some() {
                // With head slicing a rank that sends no KV heads moves only state slots.
                return Err(PlanError::Geometry {
                    what: format!(
                        "plan_rounds: prefill rank {} moves {total} bytes of state to decode \
                         rank {} but sends it no KV heads, so it is not one of the decode \
                         arena's senders: build the template with replicas_send for one arena \
                         share per writer, or plan its state slot with Template::plan",
                        prefill.tp_rank, decode.tp_rank,
                    ),
                });
            }
            return Err(PlanError::Geometry {
                what: format!(
                    "plan_rounds: prefill rank {} moves {total} bytes to decode rank {} but is \
                     not one of its senders: the two layouts publish no attention geometry, so \
                     pages move as whole items, held alike by every prefill rank of the \
                     decode rank's group and sent by one, prefill rank {}; plan that rank's \
                     rounds, or build the template with replicas_send for one arena share \
                     per writer",
                    prefill.tp_rank, decode.tp_rank, sender,
                ),
            });
        }
        let mut rounds = emit_rounds(
            (gather_buf, staged.gather.n_blocks),
            (scatter_buf, staged.scatter.n_blocks),
            cutter,
            total,
            &geometry,
            &mut alloc,
            &mut give_back,
        )?;
        rounds.bytes = total;
        rounds.direct_blocks = staged.direct_blocks;
        rounds.staged_network_blocks = staged.network.lengths.len();
        Ok(rounds)
    }

    /// `(sender index, senders)` of this template's prefill rank into the decode arena (index
    /// `None`: it moves nothing there), and its `(writer index, writers)` in the staged plan's
    /// decode region.
    #[allow(clippy::type_complexity)]
    fn senders(&self) -> Result<((Option<u32>, u32), (u32, u32))> {
        let prefill = PeerRanks::of(&self.template.layouts.0);
        let decode = PeerRanks::of(&self.template.layouts.1);
        let writer = staging_writer(prefill.tp_size, prefill.tp_rank, decode.tp_size)?;
        let tp = arena_sender(
            self.template.head_slicing(),
            self.template.replicas_send,
            (prefill.tp_size, prefill.tp_rank),
            (decode.tp_size, decode.tp_rank),
        )?;
        let pp = prefill.pp_size.max(1);
        let overflow = || PlanError::Overflow {
            what: "decode arena senders",
        };
        let senders = tp.count.checked_mul(pp).ok_or_else(overflow)?;
        let index = match tp.index {
            Some(position) => Some(
                position
                    .checked_mul(pp)
                    .and_then(|w| w.checked_add(prefill.pp_rank.min(pp - 1)))
                    .ok_or_else(overflow)?,
            ),
            None => None,
        };
        Ok(((index, senders), writer))
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
            dst_share: u64::from(index.unwrap_or(0)) * u64::from(buffers) * dst_buffer,
            buffer_bytes,
            sender: (index.unwrap_or(0), senders),
            owns_share: index.is_some(),
            writer,
        })
    }
}

/// Where rounds are cut: every round's end in the stream, and how many cuts fall inside a
/// gather block and inside a scatter block (blocks each cut splits in two).
struct Cuts {
    ends: Vec<u64>,
    gather_splits: usize,
    scatter_splits: usize,
}

/// Cuts the stream `0..total` into the fewest rounds of at most `buffer_bytes`: every round
/// but the last fills its buffer, so a cut may fall inside a block of either stage (split in
/// two there; at most one block of each stage per cut).
fn cut_rounds(gather: &[u64], scatter: &[u64], total: u64, buffer_bytes: u64) -> Result<Cuts> {
    let mut ends = Vec::new();
    let mut start = 0u64;
    while start < total {
        let cut = start.saturating_add(buffer_bytes).min(total);
        try_push(&mut ends, cut, "round ends")?;
        start = cut;
    }
    Ok(Cuts {
        gather_splits: splits_of(gather, &ends),
        scatter_splits: splits_of(scatter, &ends),
        ends,
    })
}

/// What a staged stage's staging column must hold, checked block by block as it is rewritten:
/// each block's staged value at its stream offset, and the bytes checked so far.
trait StageCheck {
    /// Whether one block at stream offset `at` whose staging value is `staged` is what the
    /// staged plan promises (branch-free, so the walk that calls it stays tight).
    fn fits(&mut self, at: u64, staged: u64, len: u64) -> bool;
    /// The stream interval `[from, until)` around `at` over which a staging value is the
    /// stream offset plus one `delta` (wrapping): what [`StageCheck::fits`] checks, for a walk
    /// that checks a run of blocks against it with no call per block.
    fn span(&mut self, at: u64) -> (u64, u64, u64);
    /// Records that blocks were checked up to stream offset `at`.
    fn checked_to(&mut self, at: u64);
    /// The staging value a block at stream offset `at` had in the staged plan (every block
    /// before it already checked, in order).
    fn original(&mut self, at: u64) -> u64;
    /// The stream offset up to which blocks were checked.
    fn done(&self) -> u64;
}

/// The staged gather writes the stream back to back: a block's destination is its offset.
struct GatherCheck {
    done: u64,
}

impl StageCheck for GatherCheck {
    fn fits(&mut self, at: u64, staged: u64, len: u64) -> bool {
        self.done = at.wrapping_add(len);
        staged == at
    }
    fn original(&mut self, at: u64) -> u64 {
        at
    }
    fn span(&mut self, _at: u64) -> (u64, u64, u64) {
        (0, u64::MAX, 0)
    }
    fn checked_to(&mut self, at: u64) {
        self.done = at;
    }
    fn done(&self) -> u64 {
        self.done
    }
}

/// The rounds' scatter, whose sources [`ScatterCutter`] wrote as round buffer addresses from
/// each block's stream offset while the staged planner emitted it: they are right by
/// construction and never read, so only the bytes covered are tracked.
struct CutScatterCheck {
    done: u64,
}

impl StageCheck for CutScatterCheck {
    fn fits(&mut self, at: u64, _staged: u64, len: u64) -> bool {
        self.done = at.wrapping_add(len);
        true
    }
    fn original(&mut self, at: u64) -> u64 {
        at
    }
    fn span(&mut self, _at: u64) -> (u64, u64, u64) {
        (0, u64::MAX, 0)
    }
    fn checked_to(&mut self, at: u64) {
        self.done = at;
    }
    fn done(&self) -> u64 {
        self.done
    }
}

/// Cuts the scatter into rounds while [`StagedPlanner`] emits it, so the scatter is walked
/// once: each round ends before the first block that would overflow its buffer (the cut
/// [`cut_major_in_place`] makes), and each block's source is written as its round buffer's
/// address plus its offset in the round. Used when the scatter is the major stage; when a
/// block is larger than a round buffer (`oversized`) the rounds are cut by [`cut_rounds`]
/// instead and these sources are not used.
struct ScatterCutter {
    bases: Bases,
    buffer_bytes: u64,
    /// Bytes of the request.
    total: u64,
    /// The current round's start and end bound in the stream, and its buffer's address.
    start: u64,
    limit: u64,
    base: u64,
    ends: Vec<u64>,
    round_offsets: Vec<usize>,
    oversized: bool,
    /// Memory for a round's end ran out (reported once the scatter is written).
    failed: Option<PlanError>,
}

/// Rounds reserved up front at most: a request of many rounds grows the lists beyond it.
const RESERVED_ROUNDS: u64 = 4096;

impl ScatterCutter {
    fn new(bases: Bases, buffer_bytes: u64) -> Self {
        Self {
            bases,
            buffer_bytes,
            total: 0,
            start: 0,
            limit: 0,
            base: bases.of(0),
            ends: Vec::new(),
            round_offsets: Vec::new(),
            oversized: false,
            failed: None,
        }
    }

    /// The round ends and each round's first block (`n` blocks in all), once every block is
    /// written (they add up to the request's bytes: the staged planner checks each range).
    fn finish(mut self, n: usize) -> Result<(Vec<u64>, Vec<usize>)> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.total > self.start {
            try_push(&mut self.ends, self.total, "round ends")?;
            try_push(&mut self.round_offsets, n, "round offsets")?;
        }
        Ok((self.ends, self.round_offsets))
    }
}

impl ScatterSources for ScatterCutter {
    const BY_STREAM: bool = true;

    fn begin(&mut self, total: u64) -> Result<()> {
        self.total = total;
        self.limit = self.buffer_bytes.min(total);
        // Two consecutive rounds hold more than a buffer, so this many rounds at most (capped:
        // the lists grow beyond it).
        let rounds = total
            .div_ceil(self.buffer_bytes.max(1))
            .saturating_mul(2)
            .saturating_add(1)
            .min(RESERVED_ROUNDS) as usize;
        self.ends = reserved(rounds, "round ends")?;
        self.round_offsets = reserved(rounds + 1, "round offsets")?;
        self.round_offsets.push(0);
        Ok(())
    }

    fn round(&self) -> (u64, u64) {
        (self.limit, self.base.wrapping_sub(self.start))
    }

    /// Starts a new round at block `index` (stream offset `at`) when the block overflows the
    /// current one, and marks a block larger than a buffer.
    #[cold]
    fn cut(&mut self, index: usize, at: u64, end: u64) -> (u64, u64) {
        if at > self.start {
            let pushed = try_push(&mut self.ends, at, "round ends")
                .and_then(|()| try_push(&mut self.round_offsets, index, "round offsets"));
            if let Err(e) = pushed {
                self.failed.get_or_insert(e);
            }
            self.start = at;
            self.limit = at.saturating_add(self.buffer_bytes).min(self.total);
            self.base = self.bases.of(self.ends.len());
        }
        if end > self.limit {
            // No more cuts: the rounds are cut again, splitting blocks.
            self.oversized = true;
            self.limit = u64::MAX;
        }
        self.round()
    }
}

/// Where one side's round buffers start: round `k` uses buffer `k % buffers`.
#[derive(Clone, Copy)]
struct Bases {
    /// The first buffer's address.
    first: u64,
    /// Bytes between buffers.
    stride: u64,
    buffers: u32,
}

impl Bases {
    fn of(&self, round: usize) -> u64 {
        self.first + (round as u64 % u64::from(self.buffers)) * self.stride
    }
}

/// The staging column (column `col`: 0 sources, 1 destinations) and the lengths of a staged
/// buffer's first `n` blocks, as slices.
fn staging_and_lengths(buf: &mut FlatBuffer, col: usize, n: usize) -> (&mut [u64], &[u64]) {
    let cap = buf.capacity;
    let (head, lengths) = buf.data.split_at_mut(2 * cap);
    (&mut head[col * cap..col * cap + n], &lengths[..n])
}

/// Cuts the major stage and rewrites it in place in one walk: each round ends before the
/// first block that would overflow its buffer. Returns the round ends and the rounds, or
/// `None` (the column restored as the staged plan had it) when a block is larger than a round
/// buffer and must be split.
#[allow(clippy::needless_bitwise_bool)] // branch-free checks per block keep the walk tight
fn cut_major_in_place<R: StageCheck>(
    buf: &mut FlatBuffer,
    (col, n): (usize, usize),
    (buffer_bytes, total): (u64, u64),
    bases: Bases,
    check: &mut impl StageCheck,
    fresh: impl FnOnce() -> R,
) -> Result<Option<(Vec<u64>, Vec<usize>)>> {
    let (column, lengths) = staging_and_lengths(buf, col, n);
    let mut ends = Vec::new();
    let mut round_offsets = reserved(1, "round offsets")?;
    round_offsets.push(0);
    let (mut start, mut at) = (0u64, 0u64);
    let mut limit = buffer_bytes.min(total);
    let mut base = bases.of(0);
    // Any block that is not what the staged plan promises (checked after the walk), and the
    // interval over which staging values are the stream offset plus `delta`.
    let mut bad = false;
    let (mut from, mut until, mut delta) = check.span(0);
    for (i, (staged, &length)) in column.iter_mut().zip(lengths).enumerate() {
        let end = at.saturating_add(length);
        if end > limit && at > start {
            try_push(&mut ends, at, "round ends")?;
            try_push(&mut round_offsets, i, "round offsets")?;
            start = at;
            limit = start.saturating_add(buffer_bytes).min(total);
            base = bases.of(ends.len());
        }
        if end > limit {
            // A block larger than a round buffer (or past the request's end): put back what
            // was rewritten, for the splitting path.
            let mut original = fresh();
            let mut from = 0u64;
            for (rewritten, &l) in column[..i].iter_mut().zip(lengths) {
                *rewritten = original.original(from);
                from += l;
            }
            return Ok(None);
        }
        if at < from || end > until {
            (from, until, delta) = check.span(at);
            bad |= ((at < from) | (end > until)) & (length != 0);
        }
        bad |= (*staged != at.wrapping_add(delta)) & (length != 0);
        *staged = base + (at - start);
        at = end;
    }
    check.checked_to(at);
    if bad {
        return Err(PlanError::InputChanged);
    }
    if at > start {
        try_push(&mut ends, at, "round ends")?;
        try_push(&mut round_offsets, n, "round offsets")?;
    }
    Ok(Some((ends, round_offsets)))
}

/// A staged stage's blocks as rounds ending at `cuts`, written into a new buffer with every
/// block a cut falls inside split in two (`splits` of them). Returns the rounds.
fn split_stage(
    buf: &FlatBuffer,
    (col, n, splits): (usize, usize, usize),
    cuts: &[u64],
    bases: Bases,
    check: &mut impl StageCheck,
    alloc: &mut impl FnMut(usize) -> Result<FlatBuffer>,
) -> Result<RoundBlocks> {
    let cap = buf.capacity;
    let mut out = RoundBlocks {
        buffer: alloc(n.saturating_add(splits))?,
        n_blocks: 0,
        round_offsets: reserved(cuts.len().saturating_add(1), "round offsets")?,
    };
    out.round_offsets.push(0);
    let (src, dst, len) = (
        &buf.data[..n],
        &buf.data[cap..cap + n],
        &buf.data[2 * cap..2 * cap + n],
    );
    let (mut next, mut at, mut start) = (0usize, 0u64, 0u64);
    for (k, &cut) in cuts.iter().enumerate() {
        let base = bases.of(k);
        while next < n && at < cut {
            let (from, to, length) = (src[next], dst[next], len[next]);
            if at >= start && !check.fits(at, [from, to][col], length) {
                return Err(PlanError::InputChanged);
            }
            let (lo, hi) = (at.max(start), (at + length).min(cut));
            if hi > lo {
                let staged = base + (lo - start);
                let block = if col == 0 {
                    (staged, to + (lo - at), hi - lo)
                } else {
                    (from + (lo - at), staged, hi - lo)
                };
                if out.n_blocks == out.buffer.capacity {
                    return Err(PlanError::InputChanged);
                }
                out.push(block);
            }
            if at + length > cut {
                break;
            }
            at += length;
            next += 1;
        }
        out.end_round()?;
        start = cut;
    }
    Ok(out)
}

/// Puts a gather's staging column (its destinations) back to each block's stream offset, as
/// the staged plan wrote it and [`cut_major_in_place`] checked it before rewriting it.
fn restore_stream_offsets(buf: &mut FlatBuffer, n: usize) {
    let (column, lengths) = staging_and_lengths(buf, 1, n);
    let mut at = 0u64;
    for (staged, &length) in column.iter_mut().zip(lengths) {
        *staged = at;
        at = at.wrapping_add(length);
    }
}

/// The lengths of a staged buffer's first `n` blocks.
fn stage_lengths(buf: &FlatBuffer, n: usize) -> &[u64] {
    &buf.data[2 * buf.capacity..2 * buf.capacity + n]
}

/// How many of `cuts` (but the last) fall strictly inside a block of `lengths`.
fn splits_of(lengths: &[u64], cuts: &[u64]) -> usize {
    let (mut i, mut at, mut splits) = (0usize, 0u64, 0usize);
    for &cut in cuts.iter().take(cuts.len().saturating_sub(1)) {
        while i < lengths.len() && at + lengths[i] <= cut {
            at += lengths[i];
            i += 1;
        }
        splits += usize::from(i < lengths.len() && at < cut);
    }
    splits
}

/// Cuts the staged plan's gather and scatter into rounds (see the module documentation) and
/// writes every round's network block and manifest. The major stage (more blocks) is cut and
/// rewritten in one walk: the scatter while the staged planner emitted it ([`ScatterCutter`]),
/// the gather in place after; the minor stage is split where the cuts fall. When a block of
/// the major stage is larger than a round buffer, or cutting at its block ends takes more
/// rounds than full buffers would, both stages are cut by [`cut_rounds`] and copied out with
/// their blocks split. The gather is checked block by block
/// ([`GatherCheck`]), and both stages must add up to the request's bytes.
///
/// # Errors
/// [`PlanError::InputChanged`] when a check fails; [`PlanError::Overflow`] for more than
/// `u32::MAX` rounds.
fn emit_rounds(
    (mut gather_buf, n_gather): (FlatBuffer, usize),
    (scatter_buf, n_scatter): (FlatBuffer, usize),
    cutter: ScatterCutter,
    total: u64,
    geometry: &RoundGeometry,
    alloc: &mut impl FnMut(usize) -> Result<FlatBuffer>,
    give_back: &mut impl FnMut(FlatBuffer),
) -> Result<StagedRounds> {
    let src_bases = geometry.src_bases();
    let dst_bases = geometry.dst_bases();
    let mut gather_check = GatherCheck { done: 0 };
    let mut scatter_check = CutScatterCheck { done: 0 };
    let gather_major = n_gather >= n_scatter;
    let oversized = cutter.oversized;
    let cut_scatter = cutter.finish(n_scatter)?;
    let fused = if gather_major {
        cut_major_in_place(
            &mut gather_buf,
            (1, n_gather),
            (geometry.buffer_bytes, total),
            src_bases,
            &mut gather_check,
            || GatherCheck { done: 0 },
        )?
    } else if oversized {
        None
    } else {
        scatter_check.checked_to(total);
        Some(cut_scatter)
    };
    // Cuts at the major stage's block ends that leave rounds short of full enough to take more
    // rounds than the buffer needs: cut at full buffers instead (the gather's staging column
    // put back to the stream offsets it was checked to hold; the scatter's is never read).
    let fewest = total.div_ceil(geometry.buffer_bytes);
    let fused = match fused {
        Some((ends, _)) if ends.len() as u64 > fewest => {
            if gather_major {
                restore_stream_offsets(&mut gather_buf, n_gather);
            }
            None
        }
        fused => fused,
    };
    let (gather, scatter, ends) = if let Some((ends, offsets)) = fused {
        // The minor stage is split where the cuts fall.
        let (major_buf, minor_buf, minor_n) = if gather_major {
            (gather_buf, scatter_buf, n_scatter)
        } else {
            (scatter_buf, gather_buf, n_gather)
        };
        let minor_lengths = &minor_buf.data[2 * minor_buf.capacity..][..minor_n];
        let splits = splits_of(minor_lengths, &ends);
        let minor = if gather_major {
            split_stage(
                &minor_buf,
                (0, minor_n, splits),
                &ends,
                dst_bases,
                &mut scatter_check,
                alloc,
            )?
        } else {
            split_stage(
                &minor_buf,
                (1, minor_n, splits),
                &ends,
                src_bases,
                &mut gather_check,
                alloc,
            )?
        };
        give_back(minor_buf);
        let major = RoundBlocks {
            buffer: major_buf,
            n_blocks: offsets.last().copied().unwrap_or(0),
            round_offsets: offsets,
        };
        if gather_major {
            (major, minor, ends)
        } else {
            (minor, major, ends)
        }
    } else {
        let cuts = cut_rounds(
            stage_lengths(&gather_buf, n_gather),
            stage_lengths(&scatter_buf, n_scatter),
            total,
            geometry.buffer_bytes,
        )?;
        let gather = split_stage(
            &gather_buf,
            (1, n_gather, cuts.gather_splits),
            &cuts.ends,
            src_bases,
            &mut gather_check,
            alloc,
        )?;
        let scatter = split_stage(
            &scatter_buf,
            (0, n_scatter, cuts.scatter_splits),
            &cuts.ends,
            dst_bases,
            &mut scatter_check,
            alloc,
        )?;
        give_back(gather_buf);
        give_back(scatter_buf);
        (gather, scatter, cuts.ends)
    };
    let gathered_all = n_gather == 0 || gather_check.done() == total;
    let scattered_all = n_scatter == 0 || scatter_check.done() == total;
    if !gathered_all || !scattered_all || ends.last().is_some_and(|&end| end != total) {
        return Err(PlanError::InputChanged);
    }
    let n_rounds = u32::try_from(ends.len()).map_err(|_| PlanError::Overflow {
        what: "the number of rounds",
    })?;
    let mut network_rounds = RoundBlocks {
        buffer: alloc(ends.len())?,
        n_blocks: 0,
        round_offsets: reserved(ends.len().saturating_add(1), "round offsets")?,
    };
    network_rounds.round_offsets.push(0);
    let mut manifests = reserved(ends.len(), "round manifests")?;
    let mut start = 0u64;
    for (k, &cut) in ends.iter().enumerate() {
        let bytes = cut - start;
        let (src, dst) = (src_bases.of(k), dst_bases.of(k));
        network_rounds.push((src, dst, bytes));
        network_rounds.end_round()?;
        manifests.push(RoundManifest {
            index: k as u32,
            n_rounds,
            buffer: (k as u64 % u64::from(geometry.buffers)) as u32,
            n_network_blocks: 1,
            sender: geometry.sender,
            offset: start,
            bytes,
            total_bytes: total,
            dst_offset: dst - geometry.dst_arena.addr,
        });
        start = cut;
    }
    Ok(StagedRounds {
        gather,
        network: network_rounds,
        scatter,
        manifests,
        buffers: geometry.buffers,
        buffer_bytes: geometry.buffer_bytes,
        sender: geometry.sender,
        dst_share: if geometry.owns_share {
            (
                geometry.dst_share,
                geometry.dst_share + u64::from(geometry.buffers) * geometry.dst_buffer,
            )
        } else {
            (0, 0)
        },
        ..StagedRounds::default()
    })
}
