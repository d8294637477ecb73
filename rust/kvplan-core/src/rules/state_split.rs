//! A state slot re-sliced between prefill and decode TP sizes ([`StateChannels`]): which bytes
//! of a decode rank's slot a prefill rank holds, and the checks that both sides describe the
//! same channels.
//!
//! A split slot is `outer_rows` rows; a row holds the rank's share of every sub-block (shard
//! group) of the model's channels, in order, each channel `bytes_per_channel` bytes (the item
//! length over rows × channels). Sub-block `G` is split evenly over a side's `tp` ranks: rank
//! `r` holds its channels `r·G/tp .. (r+1)·G/tp`. A prefill rank and a decode rank exchange the
//! overlap of their shares of each sub-block in each row: one byte slice per (row, sub-block)
//! with an overlap, and consecutive slices that continue each other on both sides merged into
//! one. A replicated split (0 channels) moves the whole slot, from the one prefill rank
//! [`sends_replicated_state`] elects.

use crate::error::{HeadProblem, PlanError, Result};
use crate::model::pieces::Fragment;
use crate::peer::entry::StateChannels;
use crate::peer::layout::Layout;
use crate::rules::heads::sends_replicated_state;

/// One side of a split pair: its split, item length, TP size and rank.
#[derive(Debug, Clone, Copy)]
struct SplitSide {
    split: StateChannels,
    item_len: u64,
    tp: u64,
    rank: u64,
}

impl SplitSide {
    fn of(layout: &Layout, entry: usize) -> Option<Self> {
        let e = layout.entry(entry);
        let context = layout.context();
        Some(Self {
            split: e.channels()?,
            item_len: e.item_len,
            tp: u64::from(context.tp_size.max(1)),
            rank: u64::from(context.tp_rank),
        })
    }

    /// Channels of the whole model (per rank × TP size).
    fn total(&self) -> u128 {
        u128::from(self.split.channels) * u128::from(self.tp)
    }

    /// Bytes of one channel in one row (a sharded split).
    fn bytes_per_channel(&self) -> u64 {
        self.item_len / (self.split.channels * self.split.outer_rows).max(1)
    }

    /// The sub-blocks' channel counts at TP 1: the groups, or one block of every channel.
    fn groups(&self, total: u64) -> Vec<u64> {
        match self.split.groups() {
            [] => vec![total],
            groups => groups.to_vec(),
        }
    }
}

fn differ(what: &'static str, src: impl ToString, dst: impl ToString) -> HeadProblem {
    HeadProblem::StateSplit {
        what,
        src: src.to_string(),
        dst: dst.to_string(),
    }
}

fn groups_text(split: &StateChannels) -> String {
    match split.groups() {
        [] => "none".into(),
        groups => format!("{groups:?}"),
    }
}

/// Why state pair (`s`, `d`) cannot be re-sliced (`None`: it can, or neither side splits). A
/// side without a split against one with it, replicated against sharded, different rows,
/// different model channel counts, different shard groups or different bytes per channel
/// are refused, naming both values. An elided pair (a prefill item of 0 bytes) moves nothing
/// and is not checked.
pub(crate) fn pair_problem(src: &Layout, s: usize, dst: &Layout, d: usize) -> Option<HeadProblem> {
    let (p, q) = (SplitSide::of(src, s), SplitSide::of(dst, d));
    let (p, q) = match (p, q) {
        (None, None) => return None,
        (Some(p), Some(q)) => (p, q),
        (p, q) => {
            let text = |side: Option<SplitSide>| {
                side.map_or_else(
                    || "no split (the slot moves whole)".to_owned(),
                    |side| format!("{} channels per rank", side.split.channels),
                )
            };
            return Some(differ(
                "presence (one side splits the slot over TP)",
                text(p),
                text(q),
            ));
        }
    };
    if p.item_len == 0 {
        return None;
    }
    if p.split.replicated() != q.split.replicated() {
        return Some(differ(
            "replication (0 channels per rank: replicated)",
            format!("{} channels per rank", p.split.channels),
            format!("{} channels per rank", q.split.channels),
        ));
    }
    if p.split.replicated() {
        return (p.item_len != q.item_len).then(|| HeadProblem::StateSplit {
            what: "replicated slot lengths",
            src: format!("{} bytes", p.item_len),
            dst: format!("{} bytes", q.item_len),
        });
    }
    if p.split.outer_rows != q.split.outer_rows {
        return Some(differ("outer rows", p.split.outer_rows, q.split.outer_rows));
    }
    if p.total() != q.total() {
        return Some(differ(
            "model channels (channels per rank × TP size)",
            format!("{} × {} = {}", p.split.channels, p.tp, p.total()),
            format!("{} × {} = {}", q.split.channels, q.tp, q.total()),
        ));
    }
    if p.split.groups() != q.split.groups() {
        return Some(differ(
            "shard groups",
            groups_text(&p.split),
            groups_text(&q.split),
        ));
    }
    if p.bytes_per_channel() != q.bytes_per_channel() {
        return Some(differ(
            "bytes per channel",
            format!("{} bytes", p.bytes_per_channel()),
            format!("{} bytes", q.bytes_per_channel()),
        ));
    }
    None
}

/// The byte slices of decode entry `d`'s slot that prefill entry `s`'s slot holds, in row and
/// sub-block order, merged where they continue each other on both sides (`None`: neither
/// side splits; empty: this rank pair moves nothing).
///
/// # Errors
/// [`PlanError::HeadMismatch`] as [`pair_problem`] says.
#[allow(clippy::many_single_char_names)]
pub(crate) fn fragments(
    src: &Layout,
    s: usize,
    dst: &Layout,
    d: usize,
) -> Result<Option<Vec<Fragment>>> {
    let (Some(p), Some(q)) = (SplitSide::of(src, s), SplitSide::of(dst, d)) else {
        if let Some(problem) = pair_problem(src, s, dst, d) {
            return Err(mismatch(src, s, d, problem));
        }
        return Ok(None);
    };
    if let Some(problem) = pair_problem(src, s, dst, d) {
        return Err(mismatch(src, s, d, problem));
    }
    if p.item_len == 0 || q.item_len == 0 {
        return Ok(Some(Vec::new()));
    }
    if p.split.replicated() {
        let tp = |side: &SplitSide| u32::try_from(side.tp).unwrap_or(u32::MAX);
        let rank = |side: &SplitSide| u32::try_from(side.rank).unwrap_or(u32::MAX);
        let sends = sends_replicated_state(tp(&p), tp(&q), rank(&p), rank(&q));
        return Ok(Some(if sends {
            vec![Fragment {
                src_off: 0,
                dst_off: 0,
                len: p.item_len,
            }]
        } else {
            Vec::new()
        }));
    }
    // Checked: same model channels (which fit u64 as a group sum or as per rank × TP of a
    // layout whose item holds them), rows and bytes per channel.
    let total = u64::try_from(p.total()).map_err(|_| PlanError::Overflow {
        what: "state channels",
    })?;
    let groups = p.groups(total);
    let bpc = p.bytes_per_channel();
    let (row_p, row_q) = (p.split.channels * bpc, q.split.channels * bpc);
    let mut out: Vec<Fragment> = Vec::new();
    for row in 0..p.split.outer_rows {
        let (mut off_p, mut off_q) = (0u64, 0u64);
        for &g in &groups {
            let (share_p, share_q) = (g / p.tp, g / q.tp);
            let (lo_p, lo_q) = (p.rank * share_p, q.rank * share_q);
            let start = lo_p.max(lo_q);
            let stop = (lo_p + share_p).min(lo_q + share_q);
            if start < stop {
                let f = Fragment {
                    src_off: row * row_p + (off_p + start - lo_p) * bpc,
                    dst_off: row * row_q + (off_q + start - lo_q) * bpc,
                    len: (stop - start) * bpc,
                };
                match out.last_mut() {
                    Some(last)
                        if last.src_off + last.len == f.src_off
                            && last.dst_off + last.len == f.dst_off =>
                    {
                        last.len += f.len;
                    }
                    _ => out.push(f),
                }
            }
            off_p += share_p;
            off_q += share_q;
        }
    }
    Ok(Some(out))
}

fn mismatch(src: &Layout, s: usize, d: usize, problem: HeadProblem) -> PlanError {
    PlanError::HeadMismatch {
        entry: Some(format!(
            "layer {}, role {} (src entry {s}, dst entry {d})",
            src.layer_label(s),
            src.role_label(s)
        )),
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::layout::LayoutContext;

    /// One state entry of `channels` channels per rank in `rows` rows of `bpc` bytes each, at
    /// TP `tp`, rank `rank`.
    fn side(channels: u64, rows: u64, groups: &[u64], bpc: u64, tp: u32, rank: u32) -> Layout {
        let item = if channels == 0 {
            bpc
        } else {
            channels * rows * bpc
        };
        split_state(channels, rows, groups, item, tp, rank).unwrap()
    }

    /// One state entry of `item` bytes a slot with the split `channels` × `rows` (`groups`),
    /// at TP `tp`, rank `rank`: the layout, or why the split does not fit it.
    fn split_state(
        channels: u64,
        rows: u64,
        groups: &[u64],
        item: u64,
        tp: u32,
        rank: u32,
    ) -> Result<Layout> {
        let context = LayoutContext {
            tp_size: tp,
            tp_rank: rank,
            ..LayoutContext::default()
        };
        Layout::mla(vec![], vec![], vec![], None, context)?
            .with_state("conv", vec![1 << 20], vec![item * 4], vec![item], vec![0])?
            .with_state_channels(vec![Some(StateChannels::new(channels, rows, groups)?)])
    }

    /// Applies the slices to byte-tagged slots: every decode byte must be the model channel
    /// the decode rank holds there, written exactly once across the prefill ranks.
    #[test]
    fn every_decode_byte_comes_from_the_prefill_rank_that_holds_it() {
        let groups = [8u64, 8, 16];
        let (rows, bpc) = (3u64, 2u64);
        for tp_p in [1u32, 2, 4, 8] {
            for tp_d in [1u32, 2, 4, 8] {
                // Channel id of byte b of a rank's slot: (row, model channel, byte in channel).
                let owner = |tp: u64, rank: u64| {
                    let mut ids = Vec::new();
                    for row in 0..rows {
                        let mut base = 0;
                        for &g in &groups {
                            for c in rank * g / tp..(rank + 1) * g / tp {
                                for b in 0..bpc {
                                    ids.push((row, base + c, b));
                                }
                            }
                            base += g;
                        }
                    }
                    ids
                };
                let total: u64 = groups.iter().sum();
                for r_d in 0..tp_d {
                    let want = owner(u64::from(tp_d), u64::from(r_d));
                    let mut got = vec![None; want.len()];
                    let mut writes = vec![0; want.len()];
                    let dst = side(total / u64::from(tp_d), rows, &groups, bpc, tp_d, r_d);
                    for r_p in 0..tp_p {
                        let have = owner(u64::from(tp_p), u64::from(r_p));
                        let src = side(total / u64::from(tp_p), rows, &groups, bpc, tp_p, r_p);
                        let frags = fragments(&src, 0, &dst, 0).unwrap().unwrap();
                        let sliced = (rows * groups.len() as u64) as usize;
                        assert!(frags.len() <= sliced, "{tp_p}->{tp_d}: {frags:?}");
                        for f in frags {
                            for k in 0..f.len {
                                let (at_p, at_d) =
                                    ((f.src_off + k) as usize, (f.dst_off + k) as usize);
                                got[at_d] = Some(have[at_p]);
                                writes[at_d] += 1;
                            }
                        }
                    }
                    let got: Vec<_> = got.into_iter().map(Option::unwrap).collect();
                    assert_eq!(got, want, "{tp_p}->{tp_d} decode rank {r_d}");
                    assert!(writes.iter().all(|&w| w == 1));
                }
            }
        }
    }

    #[test]
    fn equal_tp_moves_the_whole_slot_as_one_slice() {
        let src = side(16, 3, &[8, 8, 16], 2, 2, 1);
        let dst = side(16, 3, &[8, 8, 16], 2, 2, 1);
        let frags = fragments(&src, 0, &dst, 0).unwrap().unwrap();
        assert_eq!(
            frags,
            vec![Fragment {
                src_off: 0,
                dst_off: 0,
                len: 96
            }]
        );
    }

    #[test]
    fn replicated_state_has_one_elected_writer() {
        for (tp_p, tp_d) in [(1u32, 4u32), (4, 1), (2, 8), (8, 2), (4, 4)] {
            for r_d in 0..tp_d {
                let dst = side(0, 1, &[], 64, tp_d, r_d);
                let writers: Vec<u32> = (0..tp_p)
                    .filter(|&r_p| {
                        let src = side(0, 1, &[], 64, tp_p, r_p);
                        !fragments(&src, 0, &dst, 0).unwrap().unwrap().is_empty()
                    })
                    .collect();
                assert_eq!(writers, vec![r_d * tp_p / tp_d], "{tp_p}->{tp_d} r_d={r_d}");
            }
        }
    }

    #[test]
    fn splits_that_differ_are_refused_naming_both_values() {
        let cases = [
            (
                side(16, 3, &[], 2, 2, 0),
                side(8, 2, &[], 2, 4, 0),
                "outer rows",
                "3",
                "2",
            ),
            (
                side(16, 1, &[], 2, 2, 0),
                side(16, 1, &[], 2, 4, 0),
                "model channels",
                "32",
                "64",
            ),
            (
                side(16, 1, &[], 2, 2, 0),
                side(8, 1, &[], 4, 4, 0),
                "bytes per channel",
                "2 bytes",
                "4 bytes",
            ),
            (
                side(16, 1, &[8, 8, 16], 2, 2, 0),
                side(8, 1, &[], 2, 4, 0),
                "shard groups",
                "[8, 8, 16]",
                "none",
            ),
            (
                side(0, 1, &[], 64, 2, 0),
                side(8, 1, &[], 8, 4, 0),
                "replication",
                "0 channels",
                "8 channels",
            ),
        ];
        for (src, dst, what, a, b) in cases {
            let err = fragments(&src, 0, &dst, 0).unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, PlanError::HeadMismatch { .. }), "{text}");
            assert!(
                text.contains(what) && text.contains(a) && text.contains(b),
                "{text}"
            );
        }
    }

    #[test]
    fn layout_refuses_splits_that_do_not_fit() {
        let bad = |channels, rows, groups: &[u64], item: u64, tp: u32| {
            split_state(channels, rows, groups, item, tp, 0)
                .unwrap_err()
                .to_string()
        };
        assert!(bad(16, 3, &[], 100, 1).contains("item length 100 bytes is not 3 rows of 16"));
        assert!(bad(16, 1, &[8, 8], 32, 2).contains("sum to 16 channels"));
        assert!(bad(6, 1, &[3, 3, 6], 12, 2).contains("shard group of 3 channels"));
        assert!(StateChannels::new(0, 1, &[4]).is_err());
        assert!(StateChannels::new(4, 0, &[]).is_err());
    }
}
