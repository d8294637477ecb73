//! Prefill TP ≠ decode TP: which ranks exchange which KV heads, and the byte fragments that
//! move them.
//!
//! A model has `H` KV heads. A side with TP size `tp` gives each rank `max(1, H / tp)` heads:
//! rank `r` holds heads `r·H/tp ..` when `H ≥ tp`, and otherwise the single head
//! `r / (tp / H)`, held by `tp / H` consecutive ranks (replicated heads). One of `H` and `tp`
//! must divide the other.
//!
//! Election. A decode rank needs each of its heads exactly once. When the prefill side
//! replicates heads (`H < tp_p`, `R = tp_p / H` holders per head), the holders of head `h` are
//! prefill ranks `h·R .. h·R + R - 1`; decode rank `r_d` takes its heads from holder number
//! `r_d mod R` (the one with `r_p mod R == r_d mod R`), so consecutive decode ranks are served
//! by different replicas. Without replication (`R = 1`) every prefill rank whose heads overlap
//! the decode rank's sends them. MLA is the case `H = 1`: the latent is one replicated head.
//! A template may instead ask every holder to send (`TemplateOptions::replicas_send`,
//! [`TpSplit::link_every_holder`]): when `tp_p > tp_d`, decode rank `r_d` then receives its
//! heads from each of its `w = tp_p / tp_d` *writers*, prefill ranks `r_d·w .. (r_d+1)·w`
//! (every holder of its heads, unless the decode side replicates heads too: then the other
//! holders are other decode ranks' writers), once per writer. That is what a layout with one
//! share per prefill rank expects: SGLang's staged transfer, whose decode scatters every
//! writer's share of its staging region ([`staging_writer`]).
//!
//! State (per request, not per head), following SGLang 0.5.23's Mamba state transfer: a state
//! item whose length is equal on both sides is replicated across TP and is written to decode
//! rank `r_d` by one prefill rank only, `floor(r_d · tp_p / tp_d)` (the first prefill rank of
//! `r_d`'s share: in aggregation the first of each group of `tp_p / tp_d` writers, in scatter
//! the one rank that feeds it). A state item whose lengths are in the TP ratio
//! (`src_len · tp_p == dst_len · tp_d`) is sharded along its leading axis: rank `r` holds bytes
//! `r·len .. (r+1)·len` of the whole state, and each pair moves the overlap of the two byte
//! ranges as one block.

use crate::error::{HeadProblem, PlanError, Result, Side};
use crate::model::pieces::{Fragment, Fragments};
use crate::peer::layout::{AttentionGeometry, Layout, MemoryOrder, heads_per_rank_at};

/// How a model's KV heads are split over the prefill and the decode TP groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpSplit {
    /// KV heads of the whole model.
    pub kv_heads: u32,
    /// Prefill attention TP size.
    pub prefill_tp: u32,
    /// Decode attention TP size.
    pub decode_tp: u32,
}

/// What one (prefill rank, decode rank) pair moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// The prefill rank sends heads `start..stop` (model head numbers) to the decode rank.
    Send {
        /// First head moved.
        start: u32,
        /// One past the last head moved.
        stop: u32,
    },
    /// The prefill rank holds heads `start..stop` of the decode rank, but they are replicated
    /// and prefill rank `sender` is elected to send them.
    Replica {
        /// First overlapping head.
        start: u32,
        /// One past the last overlapping head.
        stop: u32,
        /// The prefill rank that sends these heads to this decode rank.
        sender: u32,
    },
    /// Every holder sends ([`TpSplit::link_every_holder`]): the prefill rank holds heads
    /// `start..stop` of the decode rank, but is not one of its `writers` writers (prefill
    /// ranks from `first_writer`); it writes another decode rank's region.
    OtherWriters {
        /// First overlapping head.
        start: u32,
        /// One past the last overlapping head.
        stop: u32,
        /// The decode rank's first writer.
        first_writer: u32,
        /// The decode rank's number of writers.
        writers: u32,
    },
    /// The two ranks hold no head in common.
    Disjoint,
}

impl TpSplit {
    /// Checks the split: every count at least 1, and on each side one of `kv_heads` and the TP
    /// size divides the other.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] naming the values.
    pub fn new(kv_heads: u32, prefill_tp: u32, decode_tp: u32) -> Result<Self> {
        for (name, value) in [
            ("kv_heads", kv_heads),
            ("prefill TP size", prefill_tp),
            ("decode TP size", decode_tp),
        ] {
            if value == 0 {
                return Err(geometry(format!("{name} must be at least 1, got 0")));
            }
        }
        for (name, tp) in [("prefill", prefill_tp), ("decode", decode_tp)] {
            if !kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(kv_heads) {
                return Err(geometry(format!(
                    "{name} TP size {tp} and kv_heads {kv_heads}: neither divides the other, so \
                     heads cannot be split evenly over the ranks"
                )));
            }
        }
        Ok(Self {
            kv_heads,
            prefill_tp,
            decode_tp,
        })
    }

    /// The TP size of one side.
    pub fn tp(&self, side: Side) -> u32 {
        side.pick(self.prefill_tp, self.decode_tp)
    }

    /// Heads each rank of `side` holds: `max(1, kv_heads / tp)`.
    pub fn heads_per_rank(&self, side: Side) -> u32 {
        heads_per_rank_at(self.kv_heads, self.tp(side))
    }

    /// Ranks of `side` holding each head: `max(1, tp / kv_heads)` (1 = not replicated).
    pub fn holders(&self, side: Side) -> u32 {
        (self.tp(side) / self.kv_heads).max(1)
    }

    /// Heads `(start, stop)` rank `rank` of `side` holds.
    pub fn heads(&self, side: Side, rank: u32) -> (u32, u32) {
        let per = self.heads_per_rank(side);
        let first = (rank / self.holders(side)) * per;
        (first, first + per)
    }

    fn check_rank(&self, side: Side, rank: u32) -> Result<()> {
        let tp = self.tp(side);
        if rank >= tp {
            let name = side.pick("prefill", "decode");
            return Err(geometry(format!(
                "{name} rank {rank} is outside TP size {tp} (ranks 0..{tp})"
            )));
        }
        Ok(())
    }

    /// What prefill rank `r_p` sends decode rank `r_d`.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a rank outside its TP size.
    pub fn link(&self, r_p: u32, r_d: u32) -> Result<Link> {
        self.check_rank(Side::Src, r_p)?;
        self.check_rank(Side::Dst, r_d)?;
        let (ps, pe) = self.heads(Side::Src, r_p);
        let (ds, de) = self.heads(Side::Dst, r_d);
        let (start, stop) = (ps.max(ds), pe.min(de));
        if start >= stop {
            return Ok(Link::Disjoint);
        }
        let replicas = self.holders(Side::Src);
        let elected = r_d % replicas;
        if r_p % replicas == elected {
            Ok(Link::Send { start, stop })
        } else {
            Ok(Link::Replica {
                start,
                stop,
                sender: r_p - r_p % replicas + elected,
            })
        }
    }

    /// What prefill rank `r_p` sends decode rank `r_d` when every holder of a replicated head
    /// sends it, not only the elected one (`TemplateOptions::replicas_send`). With prefill TP
    /// `tp_p` a multiple of a smaller decode TP `tp_d`, the decode rank's writers, prefill ranks
    /// `r_d·w .. (r_d+1)·w` (`w = tp_p / tp_d`), all hold its heads (at the same offsets as the
    /// elected holder) and each sends them: a [`Link::Replica`] of a writer becomes a
    /// [`Link::Send`] of the same heads, and any holder that is one of another decode rank's
    /// writers (only when the decode side replicates heads too; the elected holder may be one)
    /// a [`Link::OtherWriters`]. Otherwise (one writer per decode rank) as [`TpSplit::link`].
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a rank outside its TP size.
    pub fn link_every_holder(&self, r_p: u32, r_d: u32) -> Result<Link> {
        let link = self.link(r_p, r_d)?;
        let (tp_p, tp_d) = (self.prefill_tp, self.decode_tp);
        if tp_p <= tp_d || !tp_p.is_multiple_of(tp_d) {
            return Ok(link);
        }
        let writers = tp_p / tp_d;
        Ok(match link {
            Link::Send { start, stop } | Link::Replica { start, stop, .. }
                if r_p / writers == r_d =>
            {
                Link::Send { start, stop }
            }
            Link::Send { start, stop } | Link::Replica { start, stop, .. } => Link::OtherWriters {
                start,
                stop,
                first_writer: r_d * writers,
                writers,
            },
            other => other,
        })
    }

    /// Ranks of the other side whose heads overlap `rank`'s (in rank order): the pairs a
    /// deployment connects, elected or not.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a rank outside its TP size.
    pub fn peers(&self, side: Side, rank: u32) -> Result<Vec<u32>> {
        self.check_rank(side, rank)?;
        let other = match side {
            Side::Src => Side::Dst,
            Side::Dst => Side::Src,
        };
        let links = (0..self.tp(other)).map(|peer| {
            let (r_p, r_d) = side.pick((rank, peer), (peer, rank));
            self.link(r_p, r_d).map(|link| (peer, link))
        });
        let mut out = Vec::new();
        for item in links {
            let (peer, link) = item?;
            if link != Link::Disjoint {
                out.push(peer);
            }
        }
        Ok(out)
    }

    /// The prefill ranks that move KV heads to decode rank `r_d`, in rank order: every prefill
    /// rank whose [`TpSplit::link`] with it is a [`Link::Send`] (each unreplicated holder of
    /// its heads, and one elected holder per replicated head), or with `every_holder` whose
    /// [`TpSplit::link_every_holder`] is (its `tp_p / tp_d` writers when the prefill TP is
    /// larger). Never empty: every head of a decode rank has a sender.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a rank outside its TP size.
    pub fn kv_senders(&self, r_d: u32, every_holder: bool) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for r_p in 0..self.prefill_tp {
            let link = if every_holder {
                self.link_every_holder(r_p, r_d)?
            } else {
                self.link(r_p, r_d)?
            };
            if matches!(link, Link::Send { .. }) {
                out.push(r_p);
            }
        }
        Ok(out)
    }

    /// Whether prefill rank `r_p` writes decode rank `r_d`'s copy of a replicated state item:
    /// `r_p == floor(r_d · tp_p / tp_d)`.
    pub(crate) fn sends_replicated_state(&self, r_p: u32, r_d: u32) -> bool {
        sends_replicated_state(self.prefill_tp, self.decode_tp, r_p, r_d)
    }
}

/// The one writer rule for state replicated over TP (every state slot both sides hold whole):
/// prefill rank `r_p` writes decode rank `r_d`'s copy when `r_p == floor(r_d · tp_p / tp_d)`,
/// the first prefill rank of `r_d`'s share. With one TP size a multiple of the other this is
/// SGLang 0.5.23's `should_send_replicated_state` on the rank pairs it connects: in scatter
/// (`tp_p ≤ tp_d`) decode rank `r_d` connects only to prefill rank `floor(r_d · tp_p / tp_d)`,
/// which sends; in aggregation its `w = tp_p / tp_d` writers are prefill ranks `r_d·w ..`, and
/// the one with `r_p mod w == 0` sends. A rank pair SGLang does not connect sends nothing here.
pub fn sends_replicated_state(prefill_tp: u32, decode_tp: u32, r_p: u32, r_d: u32) -> bool {
    let (tp_p, tp_d) = (u64::from(prefill_tp.max(1)), u64::from(decode_tp.max(1)));
    u64::from(r_p) == u64::from(r_d) * tp_p / tp_d
}

/// `(writer index, number of writers)` of prefill rank `prefill_rank` in the decode staging
/// region it writes (SGLang 0.5.23's `compute_staging_layout`): when the prefill TP is larger
/// than the decode TP, `prefill_tp / decode_tp` prefill ranks fill one decode rank's region and
/// rank `r` is writer `r mod (prefill_tp / decode_tp)`; otherwise a region has one writer.
///
/// # Errors
/// [`PlanError::Geometry`] when neither TP size divides the other: a decode rank's heads then
/// come from a varying number of prefill ranks, which this layout cannot place apart.
pub fn staging_writer(prefill_tp: u32, prefill_rank: u32, decode_tp: u32) -> Result<(u32, u32)> {
    let (p, d) = (prefill_tp.max(1), decode_tp.max(1));
    if !p.is_multiple_of(d) && !d.is_multiple_of(p) {
        return Err(geometry(format!(
            "staged plans need one TP size to divide the other (prefill TP {p}, decode TP {d}): \
             otherwise the prefill ranks filling one decode rank's staging region vary in \
             number and their shares cannot be laid out apart; plan the request directly"
        )));
    }
    Ok(if p > d {
        let writers = p / d;
        (prefill_rank % writers, writers)
    } else {
        (0, 1)
    })
}

/// Where one prefill TP rank stands among the prefill TP ranks that send a decode rank bytes
/// at the same time ([`arena_sender`]): the share of a decode arena each of them owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArenaSender {
    /// The prefill rank's position among the senders; `None` when it moves no page bytes to
    /// the decode rank (a holder of replicated heads that is not elected, or whose heads are
    /// not the decode rank's): it owns no share.
    pub index: Option<u32>,
    /// Prefill TP ranks sending to the decode rank (at least 1).
    pub count: u32,
}

/// Which prefill TP ranks send one decode rank page bytes, and where `prefill_rank` stands
/// among them: the one rule for splitting a decode arena into per-sender shares (staged
/// rounds), for a template between prefill rank `prefill_rank` of TP `prefill_tp` and decode
/// rank `decode_rank` of TP `decode_tp` built with `replicas_send` or not.
///
/// - With the pair's head slicing (`slicing`: both layouts publish their attention geometry),
///   the prefill ranks whose KV heads the template moves to the decode rank
///   ([`TpSplit::kv_senders`]): one elected holder per replicated head (MLA, `kv_heads = 1`,
///   TP 2 → 1: one sender, not two; 2 KV heads over TP 4 → 1: ranks 0 and 2), with
///   `replicas_send` every writer ([`staging_writer`]).
/// - Without it, pages move as whole items. With the prefill TP larger that is data held
///   alike by every prefill rank of the decode rank's group (the decode's item is one prefill
///   rank's: MLA's latent as vLLM publishes it), so, as for replicated state
///   ([`sends_replicated_state`], and vLLM's NIXL connector for MLA), one prefill rank sends
///   it: `floor(decode_rank · prefill_tp / decode_tp)`; with `replicas_send` every writer.
///   With the prefill TP not larger, the decode rank's one writer.
///
/// State slots travel in rounds with their request's bytes, but do not make a rank a sender:
/// a rank that moves state and no KV heads to the decode rank is refused by the rounds planner
/// unless the template was built with `replicas_send` (every writer then a sender).
///
/// # Errors
/// As [`staging_writer`]; [`PlanError::Geometry`] for a rank outside its TP size.
pub fn arena_sender(
    slicing: Option<&HeadSlicing>,
    replicas_send: bool,
    (prefill_tp, prefill_rank): (u32, u32),
    (decode_tp, decode_rank): (u32, u32),
) -> Result<ArenaSender> {
    let (writer, writers) = staging_writer(prefill_tp, prefill_rank, decode_tp)?;
    let Some(slicing) = slicing else {
        if writers == 1 || replicas_send {
            return Ok(ArenaSender {
                index: Some(writer),
                count: writers,
            });
        }
        let sends = sends_replicated_state(prefill_tp, decode_tp, prefill_rank, decode_rank);
        return Ok(ArenaSender {
            index: sends.then_some(0),
            count: 1,
        });
    };
    let senders = slicing.split.kv_senders(slicing.dst_rank, replicas_send)?;
    let position = senders.iter().position(|&r| r == slicing.src_rank);
    // `kv_senders` lists at most one entry per prefill rank, fewer than 2^32.
    let count = u32::try_from(senders.len().max(1)).unwrap_or(u32::MAX);
    Ok(ArenaSender {
        index: position.and_then(|i| u32::try_from(i).ok()),
        count,
    })
}

/// Whether several prefill ranks writing one decode rank's staging region (see
/// [`staging_writer`]) hold replicas of the same heads: prefill TP above the decode TP and above
/// the KV head count. Then each writer fills its own share of the region, so a staged template
/// plans every writer (`TemplateOptions::replicas_send`), not only the elected holder.
pub fn staging_replicas_write(kv_heads: u32, prefill_tp: u32, decode_tp: u32) -> bool {
    prefill_tp > decode_tp && prefill_tp > kv_heads
}

/// Heads `start..stop` in words: `head 3`, `heads 4–7`.
pub fn heads_text(start: u32, stop: u32) -> String {
    if stop == start + 1 {
        format!("head {start}")
    } else {
        format!("heads {start}–{}", stop - 1)
    }
}

impl Link {
    /// Why this pair moves no KV, in words (`None` when it does).
    pub fn reason(&self, r_p: u32, r_d: u32, split: &TpSplit) -> Option<String> {
        match *self {
            Link::Send { .. } => None,
            Link::Replica {
                start,
                stop,
                sender,
            } => Some(format!(
                "prefill rank {r_p} holds {} of decode rank {r_d}, but they are replicated on {} \
                 prefill ranks and prefill rank {sender} is elected to send them \
                 (the holder whose rank mod {} equals the decode rank mod {})",
                heads_text(start, stop),
                split.holders(Side::Src),
                split.holders(Side::Src),
                split.holders(Side::Src),
            )),
            Link::OtherWriters {
                start,
                stop,
                first_writer,
                writers,
            } => Some(format!(
                "prefill rank {r_p} holds {} of decode rank {r_d}, replicated, and every holder \
                 sends them, but decode rank {r_d} receives them from its {writers} writers, \
                 prefill ranks {first_writer}–{}; prefill rank {r_p} writes decode rank {}",
                heads_text(start, stop),
                first_writer + writers - 1,
                r_p / writers,
            )),
            Link::Disjoint => {
                let (ps, pe) = split.heads(Side::Src, r_p);
                let (ds, de) = split.heads(Side::Dst, r_d);
                Some(format!(
                    "prefill rank {r_p} holds {} and decode rank {r_d} holds {}: no head in common",
                    heads_text(ps, pe),
                    heads_text(ds, de)
                ))
            }
        }
    }
}

/// The head slicing of one (prefill layout, decode layout) pair, when both publish their
/// attention geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadSlicing {
    /// The split both layouts agree on.
    pub split: TpSplit,
    /// Prefill rank.
    pub src_rank: u32,
    /// Decode rank.
    pub dst_rank: u32,
    /// What this pair moves.
    pub link: Link,
    src: AttentionGeometry,
    dst: AttentionGeometry,
    /// Tokens per page of the prefill and the decode layout.
    page_sizes: (u64, u64),
}

/// The heads a sliced pair moves, relative to what each side's rank holds: what a token plan
/// needs to place them on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlicedHeads {
    /// Heads moved.
    pub count: u64,
    /// Bytes of one head of one token.
    pub head_bytes: u64,
    /// Position of the first moved head among the heads the prefill rank holds.
    pub src_skip: u64,
    /// Position of the first moved head among the heads the decode rank holds.
    pub dst_skip: u64,
    /// Heads the prefill rank holds.
    pub src_heads: u64,
    /// Heads the decode rank holds.
    pub dst_heads: u64,
}

impl HeadSlicing {
    /// The slicing between two layouts; `None` when either does not publish its attention
    /// geometry (items are then copied whole, as before). Computed whatever the two page sizes
    /// and memory orders: they only decide whether the template plans by page or by token, and
    /// both plans move the heads (and the state) this slicing says. With `replicas_send`, a
    /// prefill rank holding replicated heads sends them whether or not it is the elected holder
    /// ([`TpSplit::link_every_holder`]); this is the one place the option takes effect, so page
    /// plans, token plans, checks and `empty_reason` all follow it.
    ///
    /// # Errors
    /// [`PlanError::HeadMismatch`] when the geometries cannot be bridged (different head
    /// dims, element sizes or model head counts, or heads per rank that do not follow from the
    /// TP size), naming both values.
    pub fn between(src: &Layout, dst: &Layout, replicas_send: bool) -> Result<Option<Self>> {
        let (sc, dc) = (src.context(), dst.context());
        let (Some(s), Some(d)) = (sc.attention, dc.attention) else {
            return Ok(None);
        };
        let mismatch = |problem: HeadProblem| PlanError::HeadMismatch {
            entry: None,
            problem,
        };
        let differ = |what: &'static str, src: String, dst: String| {
            mismatch(HeadProblem::Differ { what, src, dst })
        };
        if s.total_kv_heads != d.total_kv_heads {
            return Err(differ(
                "model KV head counts (kv_heads)",
                s.total_kv_heads.to_string(),
                d.total_kv_heads.to_string(),
            ));
        }
        if s.head_dim != d.head_dim {
            return Err(differ(
                "head dims",
                s.head_dim.to_string(),
                d.head_dim.to_string(),
            ));
        }
        if s.dtype_size != d.dtype_size {
            return Err(differ(
                "element sizes (dtype_size)",
                format!("{} bytes", s.dtype_size),
                format!("{} bytes", d.dtype_size),
            ));
        }
        let split = TpSplit::new(s.total_kv_heads, sc.tp_size, dc.tp_size).map_err(|e| {
            mismatch(HeadProblem::Split {
                what: e.to_string(),
            })
        })?;
        for (side, g) in [(Side::Src, &s), (Side::Dst, &d)] {
            let want = split.heads_per_rank(side);
            if g.heads_per_rank != want {
                return Err(mismatch(HeadProblem::HeadsPerRank {
                    side,
                    published: g.heads_per_rank,
                    kv_heads: split.kv_heads,
                    tp: split.tp(side),
                    want,
                }));
            }
        }
        let link = if replicas_send {
            split.link_every_holder(sc.tp_rank, dc.tp_rank)?
        } else {
            split.link(sc.tp_rank, dc.tp_rank)?
        };
        Ok(Some(Self {
            split,
            src_rank: sc.tp_rank,
            dst_rank: dc.tp_rank,
            link,
            src: s,
            dst: d,
            page_sizes: (sc.page_size, dc.page_size),
        }))
    }

    /// Why this pair moves no KV (`None` when it does).
    pub fn empty_reason(&self) -> Option<String> {
        self.link.reason(self.src_rank, self.dst_rank, &self.split)
    }

    /// The heads moved, when the pair moves any and they are a strict part of an item on
    /// either side (`None`: nothing moves, or whole items move).
    fn sliced(&self) -> Option<(u32, u32)> {
        match self.link {
            Link::Send { start, stop } => {
                let whole = stop - start == self.src.heads_per_rank
                    && stop - start == self.dst.heads_per_rank;
                (!whole).then_some((start, stop))
            }
            _ => None,
        }
    }

    /// Whether the pair moves every head each rank holds (whole items, or whole tokens of a
    /// token plan).
    pub(crate) fn moves_whole_heads(&self) -> bool {
        self.moves_pages() && self.sliced().is_none()
    }

    /// The heads moved when they are a strict part of a token on either side (`None`: nothing
    /// moves, or every head of both ranks moves).
    pub fn sliced_heads(&self) -> Option<SlicedHeads> {
        let (start, stop) = self.sliced()?;
        let (src_first, _) = self.split.heads(Side::Src, self.src_rank);
        let (dst_first, _) = self.split.heads(Side::Dst, self.dst_rank);
        Some(SlicedHeads {
            count: u64::from(stop - start),
            head_bytes: self.src.head_bytes(),
            src_skip: u64::from(start - src_first),
            dst_skip: u64::from(start - dst_first),
            src_heads: u64::from(self.src.heads_per_rank),
            dst_heads: u64::from(self.dst.heads_per_rank),
        })
    }

    /// Whether a page pair of these item lengths can be planned: equal lengths when whole items
    /// move (or nothing moves), else each the item the geometry implies on its own side (the
    /// pair's page size on that side, `page_sizes`, × heads per rank × head bytes), for page
    /// plans and token plans alike.
    pub(crate) fn check_page_items(
        &self,
        src_item: u64,
        dst_item: u64,
        page_sizes: (u64, u64),
    ) -> std::result::Result<(), HeadProblem> {
        if self.sliced().is_none() {
            let nothing_moves = !self.moves_pages();
            return if src_item == dst_item || nothing_moves {
                Ok(())
            } else {
                Err(HeadProblem::ItemsDiffer { src_item, dst_item })
            };
        }
        for (side, have) in [(Side::Src, src_item), (Side::Dst, dst_item)] {
            let g = side.pick(&self.src, &self.dst);
            let page_size = side.pick(page_sizes.0, page_sizes.1);
            let want = page_size * g.token_bytes();
            if have != want {
                return Err(HeadProblem::SlicedItem {
                    side,
                    page_size,
                    heads: g.heads_per_rank,
                    head_dim: g.head_dim,
                    dtype_size: g.dtype_size,
                    want,
                    have,
                });
            }
        }
        Ok(())
    }

    /// Whether any page bytes move.
    pub(crate) fn moves_pages(&self) -> bool {
        matches!(self.link, Link::Send { .. })
    }

    /// The fragments of every page pair of a page plan (both sides with the same page size and
    /// memory order): whole items, or the moved heads (HND: one fragment per page; NHD: one per
    /// token slot). Token plans place the heads themselves from [`HeadSlicing::sliced_heads`].
    pub(crate) fn page_fragments(&self) -> Fragments {
        let Some(sliced) = self.sliced_heads() else {
            return Fragments::Whole;
        };
        let SlicedHeads {
            count,
            head_bytes: head,
            src_skip,
            dst_skip,
            src_heads: hp,
            dst_heads: hd,
        } = sliced;
        let page_size = self.page_sizes.0;
        match self.src.memory_order {
            MemoryOrder::Hnd => {
                let per_head = page_size * head;
                Fragments::Every(vec![Fragment {
                    src_off: src_skip * per_head,
                    dst_off: dst_skip * per_head,
                    len: count * per_head,
                }])
            }
            MemoryOrder::Nhd => Fragments::Every(
                (0..page_size)
                    .map(|t| Fragment {
                        src_off: (t * hp + src_skip) * head,
                        dst_off: (t * hd + dst_skip) * head,
                        len: count * head,
                    })
                    .collect(),
            ),
        }
    }

    /// The one fragment of a state item of these lengths this pair moves (`None`: none).
    ///
    /// # Errors
    /// [`PlanError::HeadMismatch`] when the lengths are neither equal (replicated state) nor in
    /// the TP ratio (state sharded along its leading axis).
    pub(crate) fn state_fragment(
        &self,
        src_item: u64,
        dst_item: u64,
    ) -> std::result::Result<Option<Fragment>, HeadProblem> {
        let (tp_p, tp_d) = (
            u64::from(self.split.prefill_tp),
            u64::from(self.split.decode_tp),
        );
        let (r_p, r_d) = (u64::from(self.src_rank), u64::from(self.dst_rank));
        if src_item == dst_item {
            let sends = self
                .split
                .sends_replicated_state(self.src_rank, self.dst_rank);
            return Ok(sends.then_some(Fragment {
                src_off: 0,
                dst_off: 0,
                len: src_item,
            }));
        }
        let total = src_item.checked_mul(tp_p);
        if total.is_none() || total != dst_item.checked_mul(tp_d) {
            return Err(HeadProblem::StateRatio {
                src_item,
                tp_p,
                dst_item,
                tp_d,
            });
        }
        let (src_start, dst_start) = (r_p * src_item, r_d * dst_item); // <= total: no overflow
        let start = src_start.max(dst_start);
        let stop = (src_start + src_item).min(dst_start + dst_item);
        Ok((start < stop).then(|| Fragment {
            src_off: start - src_start,
            dst_off: start - dst_start,
            len: stop - start,
        }))
    }
}

fn geometry(what: String) -> PlanError {
    PlanError::Geometry { what }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_per_rank_is_the_split_and_the_layout_default() {
        for h in [1u32, 2, 4, 8, 16] {
            for tp in [1u32, 2, 4, 8] {
                let per = heads_per_rank_at(h, tp);
                assert_eq!(per, (h / tp).max(1));
                let split = TpSplit::new(h, tp, 1).unwrap();
                assert_eq!(split.heads_per_rank(Side::Src), per);
                let g = AttentionGeometry::for_rank(h, 1, 1, tp, None, None);
                assert_eq!(g.heads_per_rank, per);
            }
        }
        assert_eq!(heads_per_rank_at(8, 0), 8, "an unset TP size counts as 1");
    }

    #[test]
    fn every_decode_head_has_exactly_one_sender() {
        for h in [1u32, 2, 4, 8, 16] {
            for tp_p in [1u32, 2, 4, 8] {
                for tp_d in [1u32, 2, 4, 8] {
                    let split = TpSplit::new(h, tp_p, tp_d).unwrap();
                    for r_d in 0..tp_d {
                        let (ds, de) = split.heads(Side::Dst, r_d);
                        let mut got = vec![0; h as usize];
                        for r_p in 0..tp_p {
                            if let Link::Send { start, stop } = split.link(r_p, r_d).unwrap() {
                                assert!(split.peers(Side::Dst, r_d).unwrap().contains(&r_p));
                                (start..stop).for_each(|x| got[x as usize] += 1);
                            }
                        }
                        for x in 0..h {
                            let want = u32::from((ds..de).contains(&x));
                            assert_eq!(got[x as usize], want, "H={h} {tp_p}->{tp_d} r_d={r_d}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn replicas_write_only_with_several_writers_of_replicated_heads() {
        // (kv heads, prefill TP, decode TP) -> several writers holding the same heads
        for (heads, tp_p, tp_d, want) in [
            (2, 8, 2, true),  // 4 writers per region, each head held by 4 prefill ranks
            (8, 8, 2, false), // 4 writers, every head held once
            (2, 2, 8, false), // one writer per region
            (4, 8, 8, false), // equal TP: one writer
            (1, 4, 1, true),
        ] {
            assert_eq!(
                staging_replicas_write(heads, tp_p, tp_d),
                want,
                "{heads} heads, TP {tp_p} -> {tp_d}"
            );
        }
    }

    #[test]
    fn every_writer_sends_with_replicas_send() {
        for h in [1u32, 2, 4, 8, 16] {
            for tp_p in [1u32, 2, 4, 8] {
                for tp_d in [1u32, 2, 4, 8] {
                    let split = TpSplit::new(h, tp_p, tp_d).unwrap();
                    for r_d in 0..tp_d {
                        let (ds, de) = split.heads(Side::Dst, r_d);
                        let mut got = vec![0; h as usize];
                        for r_p in 0..tp_p {
                            let link = split.link_every_holder(r_p, r_d).unwrap();
                            if tp_p <= tp_d {
                                assert_eq!(link, split.link(r_p, r_d).unwrap());
                            }
                            if let Link::Send { start, stop } = link {
                                if tp_p > tp_d {
                                    assert_eq!(r_p / (tp_p / tp_d), r_d, "H={h} {tp_p}->{tp_d}");
                                }
                                (start..stop).for_each(|x| got[x as usize] += 1);
                            }
                        }
                        // Every head of the decode rank arrives, once per writer holding it.
                        let per_writer = split.heads_per_rank(Side::Src).min(de - ds);
                        let total: u32 = got.iter().sum();
                        if tp_p > tp_d {
                            assert_eq!(total, (tp_p / tp_d) * per_writer, "H={h} {tp_p}->{tp_d}");
                        }
                        for x in 0..h {
                            assert_eq!(got[x as usize] > 0, (ds..de).contains(&x));
                        }
                    }
                }
            }
        }
        let split = TpSplit::new(1, 8, 2).unwrap();
        assert_eq!(
            split.link_every_holder(6, 1).unwrap(),
            Link::Send { start: 0, stop: 1 }
        );
        assert_eq!(
            split.link_every_holder(1, 1).unwrap(),
            Link::OtherWriters {
                start: 0,
                stop: 1,
                first_writer: 4,
                writers: 4
            }
        );
    }

    #[test]
    fn kv_senders_are_the_elected_holders_or_every_writer() {
        // (kv heads, prefill TP, decode TP, decode rank) -> elected senders, every writer
        for (h, tp_p, tp_d, r_d, elected, writers) in [
            (1, 2, 1, 0, vec![0], vec![0, 1]),
            (1, 4, 1, 0, vec![0], vec![0, 1, 2, 3]),
            (1, 4, 2, 1, vec![1], vec![2, 3]),
            (2, 4, 1, 0, vec![0, 2], vec![0, 1, 2, 3]),
            (8, 2, 1, 0, vec![0, 1], vec![0, 1]),
            (8, 8, 2, 1, vec![4, 5, 6, 7], vec![4, 5, 6, 7]),
            (8, 2, 4, 3, vec![1], vec![1]),
        ] {
            let split = TpSplit::new(h, tp_p, tp_d).unwrap();
            assert_eq!(split.kv_senders(r_d, false).unwrap(), elected, "H={h}");
            assert_eq!(split.kv_senders(r_d, true).unwrap(), writers, "H={h}");
        }
        // Without attention geometry (whole items): one sender, floor(r_d · tp_p / tp_d), or
        // with replicas_send every staging writer.
        let whole = |r_p, (tp_p, tp_d, r_d), every| {
            arena_sender(None, every, (tp_p, r_p), (tp_d, r_d)).unwrap()
        };
        let one = |index| ArenaSender { index, count: 1 };
        assert_eq!(whole(0, (2, 1, 0), false), one(Some(0)));
        assert_eq!(whole(1, (2, 1, 0), false), one(None));
        assert_eq!(whole(2, (4, 2, 1), false), one(Some(0)));
        assert_eq!(whole(1, (4, 2, 1), false), one(None));
        assert_eq!(whole(0, (1, 2, 1), false), one(Some(0)));
        assert_eq!(
            whole(3, (4, 1, 0), true),
            ArenaSender {
                index: Some(3),
                count: 4
            }
        );
        assert!(arena_sender(None, false, (3, 0), (2, 0)).is_err());
    }

    #[test]
    fn example_8_to_2_and_mla() {
        let split = TpSplit::new(8, 8, 2).unwrap();
        assert_eq!(split.peers(Side::Dst, 1).unwrap(), vec![4, 5, 6, 7]);
        assert_eq!(split.link(5, 1).unwrap(), Link::Send { start: 5, stop: 6 });
        let mla = TpSplit::new(1, 8, 2).unwrap();
        assert_eq!(mla.link(1, 1).unwrap(), Link::Send { start: 0, stop: 1 });
        assert_eq!(
            mla.link(3, 1).unwrap(),
            Link::Replica {
                start: 0,
                stop: 1,
                sender: 1
            }
        );
        assert!(TpSplit::new(3, 2, 1).is_err());
    }
}
