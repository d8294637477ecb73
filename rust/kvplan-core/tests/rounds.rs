//! Staged rounds: a request's staged plan cut into rounds through bounded arenas. Running every
//! round (gather into its prefill round buffer, network into the same-numbered decode round
//! buffer, scatter out of it) on byte arenas must leave the decode pool byte for byte as the
//! direct plan leaves it, over TP sizes {1,2,4,8}², head counts, memory orders, PP, page-size
//! ratios and hybrid state, with arenas from one byte per round buffer up to more than the
//! request (one round); no round ever touches a byte outside its own round buffer. Several
//! senders (prefill TP writers, PP stages) share one decode arena, each in its own share. Bad
//! arenas are typed errors naming the values; manifests survive their wire form.
//!
//! A fixed-seed sample of a few hundred cases runs by default; `KVPLAN_ROUNDS_EXAMPLES` sets
//! the count (10⁴ or more for an open-ended search).

mod support;

use kvplan_core::{
    Arena, Layout, MemoryOrder, Plan, PlanError, Request, RoundManifest, RoundsPlanner, Side,
    StagedPlanner, StagedRounds, StagingRegion, Template, TemplateOptions,
};
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, heads, paged};
use support::reference::{Arena as Bytes, apply};
use support::staged_cases::{Case, DST_BASE, Drawn, Lcg, Pair, SRC_BASE, draw, layout};

const SRC_ARENA: u64 = 0x4000_0000;
const DST_ARENA: u64 = 0xC000_0000;

/// Byte memory at an address.
struct Region {
    base: u64,
    bytes: Vec<u8>,
}

impl Region {
    fn at(&self, addr: u64, len: u64) -> Option<std::ops::Range<usize>> {
        let start = addr.checked_sub(self.base)? as usize;
        let end = start.checked_add(len as usize)?;
        (end <= self.bytes.len()).then_some(start..end)
    }
}

/// Copies every block of `plan` from `from` into `to`, asserting each block lies inside the
/// allowed window `[lo, hi)` of its destination and inside both regions.
fn copy(plan: &Plan, from: &Region, to: &mut Region, window: (u64, u64), what: &str) {
    for k in 0..plan.lengths.len() {
        let (s, d, l) = (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]);
        assert!(l > 0, "{what}: empty block {k}");
        assert!(
            d >= window.0 && d + l <= window.1,
            "{what}: block {k} [{d:#x}, +{l}) leaves its window [{:#x}, {:#x})",
            window.0,
            window.1
        );
        let src = from
            .at(s, l)
            .unwrap_or_else(|| panic!("{what}: source {s:#x}+{l}"));
        let dst = to
            .at(d, l)
            .unwrap_or_else(|| panic!("{what}: dest {d:#x}+{l}"));
        let bytes = from.bytes[src].to_vec();
        to.bytes[dst].copy_from_slice(&bytes);
    }
}

fn arena(addr: u64, size: u64) -> Arena {
    Arena { addr, size }
}

/// Runs every round of `rounds` from `source` into `out`, through arenas of `src_size` and
/// `dst_size` bytes, checking each round against its manifest and its buffers.
fn run_rounds(
    rounds: &StagedRounds,
    (src_size, dst_size): (u64, u64),
    source: &Bytes,
    out: &mut Bytes,
    dst_arena: &mut Region,
) {
    let src_mem = Region {
        base: source.base,
        bytes: source.bytes.clone(),
    };
    let mut src_arena = Region {
        base: SRC_ARENA,
        bytes: vec![0; src_size as usize],
    };
    let mut dst_mem = Region {
        base: out.base,
        bytes: std::mem::take(&mut out.bytes),
    };
    let buffers = u64::from(rounds.buffers);
    let (sender, senders) = rounds.sender;
    let share = dst_size / u64::from(senders);
    if rounds.dst_share == (0, 0) {
        // a prefill rank that moves nothing to the decode rank owns no share
        assert!(rounds.is_empty() && rounds.bytes == 0 && sender == 0);
    } else {
        assert_eq!(
            rounds.dst_share,
            (u64::from(sender) * share, u64::from(sender + 1) * share)
        );
    }
    let mut offset = 0;
    for (k, manifest) in rounds.manifests.iter().enumerate() {
        let back = RoundManifest::from_bytes(&manifest.to_bytes()).unwrap();
        assert_eq!(&back, manifest);
        assert_eq!(manifest.index as usize, k);
        assert_eq!(manifest.n_rounds as usize, rounds.len());
        assert_eq!(u64::from(manifest.buffer), k as u64 % buffers);
        assert_eq!(manifest.offset, offset);
        assert!(manifest.bytes > 0 && manifest.bytes <= rounds.buffer_bytes);
        offset += manifest.bytes;
        let b = u64::from(manifest.buffer);
        let src_window = (
            SRC_ARENA + b * (src_size / buffers),
            SRC_ARENA + b * (src_size / buffers) + rounds.buffer_bytes,
        );
        let (lo, hi) = manifest.dst_bytes_range();
        assert_eq!(lo, rounds.dst_share.0 + b * (share / buffers));
        assert!(hi <= rounds.dst_share.1 && hi - lo <= share / buffers);
        let dst_window = (DST_ARENA + lo, DST_ARENA + hi);
        let (gather, network, scatter) = (
            rounds.gather.round(k),
            rounds.network.round(k),
            rounds.scatter.round(k),
        );
        assert_eq!(gather.total_bytes, manifest.bytes);
        assert_eq!(scatter.total_bytes, manifest.bytes);
        assert_eq!(network.lengths, [manifest.bytes]);
        assert_eq!(network.src_addrs[0], src_window.0);
        assert_eq!(network.dst_addrs[0], dst_window.0);
        copy(&gather, &src_mem, &mut src_arena, src_window, "gather");
        copy(&network, &src_arena, dst_arena, dst_window, "network");
        // The scatter reads only this round's decode bytes.
        for k in 0..scatter.lengths.len() {
            let (s, l) = (scatter.src_addrs[k], scatter.lengths[k]);
            assert!(
                s >= dst_window.0 && s + l <= dst_window.1,
                "scatter reads outside"
            );
        }
        copy(&scatter, dst_arena, &mut dst_mem, (0, u64::MAX), "scatter");
    }
    assert_eq!(offset, rounds.bytes);
    out.bytes = dst_mem.bytes;
}

/// Plans one (prefill rank, decode rank) pair directly and in rounds through arenas whose
/// round buffers hold `buffer_bytes` (a multiple of the senders on the decode), runs both and
/// asserts they leave the same bytes. Returns the rounds.
fn check_rounds(pair: &Pair, buffer_bytes: u64, buffers: u32) -> StagedRounds {
    let Drawn {
        case,
        r_p,
        r_d,
        stage,
    } = pair.drawn;
    let (src, dst, template) = (&pair.src, &pair.dst, &pair.template);
    let request = pair.request();
    let direct = template.plan(&request).unwrap();
    let mut source = Bytes::numbered(src);
    for byte in &mut source.bytes {
        *byte = ((u32::from(*byte) + 37 * r_p) % 255 + 1) as u8;
    }
    let mut want = Bytes::zeroed(dst);
    apply(src, dst, &direct, &source, &mut want);
    let (position, tp_senders) = if template.head_slicing().is_some() {
        expected_sender(case.heads, case.tp_p, case.tp_d, r_p, r_d)
    } else {
        // no attention geometry: items move whole, from one prefill rank per decode rank
        let sender = r_d * case.tp_p.max(case.tp_d) / case.tp_d;
        ((r_p == sender || case.tp_p <= case.tp_d).then_some(0), 1)
    };
    let senders = tp_senders * case.pp_p;
    let sizes = (
        buffer_bytes * u64::from(buffers),
        buffer_bytes * u64::from(buffers) * u64::from(senders),
    );
    let rounds = RoundsPlanner::new(template)
        .plan(
            &request,
            arena(SRC_ARENA, sizes.0),
            arena(DST_ARENA, sizes.1),
            buffers,
        )
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    let want_index = position.map_or(0, |i| i * case.pp_p + stage);
    assert_eq!(rounds.sender, (want_index, senders), "{case:?} r_p={r_p}");
    assert_eq!(
        rounds.dst_share == (0, 0),
        position.is_none(),
        "{case:?} r_p={r_p}"
    );
    assert_eq!(rounds.buffer_bytes, buffer_bytes);
    assert_eq!(rounds.bytes, direct.total_bytes);
    assert_eq!(rounds.direct_blocks, direct.lengths.len());
    assert_eq!(
        rounds.len() as u64,
        direct.total_bytes.div_ceil(buffer_bytes),
        "{case:?}: more rounds than the buffer needs"
    );
    let mut got = Bytes::zeroed(dst);
    let mut dst_arena = Region {
        base: DST_ARENA,
        bytes: vec![0; sizes.1 as usize],
    };
    run_rounds(&rounds, sizes, &source, &mut got, &mut dst_arena);
    assert!(
        got.bytes == want.bytes,
        "rounds differ from the direct plan: {case:?} r_p={r_p} stage={stage} r_d={r_d} \
         buffer={buffer_bytes} buffers={buffers}"
    );
    rounds
}

/// `(position, count)` of prefill rank `r_p` among the prefill ranks that send decode rank
/// `r_d` KV heads, with `heads` KV heads over TP `tp_p` → `tp_d` and one elected holder per
/// replicated head (position `None`: it sends none), written out here from the head split
/// (rank `r` of TP `tp` holds heads `r / (tp / H)` replicated, else `r·H/tp ..`) rather than
/// taken from the core.
fn expected_sender(heads: u32, tp_p: u32, tp_d: u32, r_p: u32, r_d: u32) -> (Option<u32>, u32) {
    let held = |tp: u32, r: u32| {
        let per = (heads / tp).max(1);
        let first = (r / (tp / heads).max(1)) * per;
        (first, first + per)
    };
    let replicas = (tp_p / heads).max(1);
    let (ds, de) = held(tp_d, r_d);
    let senders: Vec<u32> = (0..tp_p)
        .filter(|&r| {
            let (ps, pe) = held(tp_p, r);
            ps.max(ds) < pe.min(de) && r % replicas == r_d % replicas
        })
        .collect();
    let position = senders.iter().position(|&r| r == r_p).map(|i| i as u32);
    (position, senders.len() as u32)
}

fn examples() -> usize {
    std::env::var("KVPLAN_ROUNDS_EXAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// The (prefill, decode) page sizes the property loops draw from.
const PAGE_SIZES: [(u64, u64); 7] = [
    (1, 1),
    (16, 16),
    (4, 4),
    (16, 64),
    (64, 16),
    (1, 16),
    (4, 1),
];

/// The next case `rng` draws over [`PAGE_SIZES`] (odd page counts and state included), planned.
fn next_pair(rng: &mut Lcg) -> Pair {
    loop {
        if let Some(drawn) = draw(rng, &PAGE_SIZES, true, true) {
            return drawn.pair();
        }
    }
}

/// Random cases over TP {1,2,4,8}², heads, orders, PP, page ratios and state, each planned for
/// one decode rank and one of its prefill ranks (and stage), with round buffers from one byte
/// to more than the request.
#[test]
fn rounds_equal_the_direct_plan() {
    let mut rng = Lcg(0x9E37_79B9_7F4A_7C15);
    let (mut done, mut one_round, mut split_blocks) = (0, 0, 0);
    while done < examples() {
        let pair = next_pair(&mut rng);
        // The request's bytes, from the staged plan's counts, to pick a round buffer.
        let bytes = StagedPlanner::new(&pair.template)
            .counts(&pair.request())
            .unwrap()
            .bytes;
        let buffer_bytes = match rng.next() % 6 {
            0 if bytes <= 4096 => 1,
            0 | 1 => 1 + rng.next() % 64,
            2 => (bytes / 3).max(1),
            3 => (bytes / 2 + 1).max(1),
            4 => bytes.max(1),
            _ => bytes + 1 + rng.next() % 1000,
        };
        let buffers = rng.pick(&[1, 2, 2, 3]);
        let rounds = check_rounds(&pair, buffer_bytes, buffers);
        one_round += usize::from(rounds.len() == 1);
        let staged_blocks = rounds.gather.round_offsets.len();
        split_blocks += usize::from(staged_blocks > 2 && buffer_bytes < 64);
        done += 1;
    }
    assert!(
        one_round > 0 && split_blocks > 0,
        "{one_round} {split_blocks}"
    );
}

/// TP 8 → 2 (PP 1 and 2): the senders of decode rank 1 (four prefill ranks, each stage) write
/// their rounds into their own shares of one decode arena; run round-robin (every sender's
/// round k before any round k+1) they never overwrite each other, and the decode pool equals
/// every sender's direct plan applied.
#[test]
fn senders_share_one_decode_arena() {
    for pp_p in [1, 2] {
        let case = Case {
            heads: 8,
            tp_p: 8,
            tp_d: 2,
            order: MemoryOrder::Nhd,
            pp_p,
            page_sizes: (16, 16),
            tokens: 48,
            state: false,
            layers: 4,
        };
        let r_d = 1;
        let buffer_bytes = 200;
        let buffers = 2u32;
        let senders = 4 * pp_p;
        let dst_size = buffer_bytes * u64::from(buffers * senders);
        let dst = layout(&case, Side::Dst, r_d, 0);
        let mut want = Bytes::zeroed(&dst);
        let mut got = Bytes::zeroed(&dst);
        let mut dst_arena = Region {
            base: DST_ARENA,
            bytes: vec![0; dst_size as usize],
        };
        let mut all = Vec::new();
        for r_p in 4..8 {
            for stage in 0..pp_p {
                let src = layout(&case, Side::Src, r_p, stage);
                let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
                let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
                let request = Request::pages(&sp, &dp);
                let mut source = Bytes::numbered(&src);
                for byte in &mut source.bytes {
                    *byte = ((u32::from(*byte) + 37 * r_p) % 255 + 1) as u8;
                }
                apply(
                    &src,
                    &dst,
                    &template.plan(&request).unwrap(),
                    &source,
                    &mut want,
                );
                let rounds = RoundsPlanner::new(&template)
                    .plan(
                        &request,
                        arena(SRC_ARENA, buffer_bytes * u64::from(buffers)),
                        arena(DST_ARENA, dst_size),
                        buffers,
                    )
                    .unwrap();
                assert_eq!(rounds.sender, ((r_p % 4) * pp_p + stage, senders));
                all.push((rounds, source));
            }
        }
        // Shares tile the arena.
        let mut shares: Vec<(u64, u64)> = all.iter().map(|(r, _)| r.dst_share).collect();
        shares.sort_unstable();
        assert_eq!(shares[0].0, 0);
        assert_eq!(shares.last().unwrap().1, dst_size);
        assert!(shares.windows(2).all(|w| w[0].1 == w[1].0));
        // Round-robin: every sender's network of round k lands before any scatter of round k.
        let most = all.iter().map(|(r, _)| r.len()).max().unwrap();
        let mut src_arenas: Vec<Region> = all
            .iter()
            .map(|_| Region {
                base: SRC_ARENA,
                bytes: vec![0; (buffer_bytes * u64::from(buffers)) as usize],
            })
            .collect();
        let mut out = Region {
            base: got.base,
            bytes: std::mem::take(&mut got.bytes),
        };
        for k in 0..most {
            for ((rounds, source), src_arena) in all.iter().zip(&mut src_arenas) {
                if k < rounds.len() {
                    let mem = Region {
                        base: source.base,
                        bytes: source.bytes.clone(),
                    };
                    let full = (0, u64::MAX);
                    copy(&rounds.gather.round(k), &mem, src_arena, full, "gather");
                    let (lo, hi) = rounds.manifests[k].dst_bytes_range();
                    let window = (DST_ARENA + lo, DST_ARENA + hi);
                    copy(
                        &rounds.network.round(k),
                        src_arena,
                        &mut dst_arena,
                        window,
                        "net",
                    );
                }
            }
            for (rounds, _) in &all {
                if k < rounds.len() {
                    let full = (0, u64::MAX);
                    copy(
                        &rounds.scatter.round(k),
                        &dst_arena,
                        &mut out,
                        full,
                        "scatter",
                    );
                }
            }
        }
        assert!(
            out.bytes == want.bytes,
            "PP {pp_p}: senders overwrote each other"
        );
    }
}

fn small_case() -> Case {
    Case {
        heads: 8,
        tp_p: 8,
        tp_d: 2,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (16, 16),
        tokens: 32,
        state: true,
        layers: 2,
    }
}

/// Bad arenas and buffer counts are typed errors naming the values, before any planning.
#[test]
fn bad_arenas_are_typed_errors() {
    let case = small_case();
    let src = layout(&case, Side::Src, 5, 0);
    let dst = layout(&case, Side::Dst, 1, 0);
    let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
    let request = Request::pages(&sp, &dp);
    let plan =
        |s: Arena, d: Arena, buffers| RoundsPlanner::new(&template).plan(&request, s, d, buffers);
    // Four writers: the decode arena splits into 4 shares × 2 buffers.
    let ok = plan(arena(SRC_ARENA, 64), arena(DST_ARENA, 256), 2).unwrap();
    assert_eq!(ok.buffer_bytes, 32);
    assert_eq!(ok.sender, (1, 4));
    let zero = plan(arena(SRC_ARENA, 64), arena(DST_ARENA, 256), 0).unwrap_err();
    assert!(
        matches!(&zero, PlanError::Geometry { what } if what.contains("buffers=0")),
        "{zero}"
    );
    let odd = plan(arena(SRC_ARENA, 65), arena(DST_ARENA, 256), 2).unwrap_err();
    assert!(
        matches!(&odd, PlanError::Geometry { what } if what.contains("65 bytes")
            && what.contains("multiple of 2")),
        "{odd}"
    );
    let odd = plan(arena(SRC_ARENA, 64), arena(DST_ARENA, 252), 2).unwrap_err();
    assert!(
        matches!(&odd, PlanError::Geometry { what } if what.contains("252 bytes")
            && what.contains("4 sender share(s)") && what.contains("multiple of 8")),
        "{odd}"
    );
    let empty = plan(arena(SRC_ARENA, 0), arena(DST_ARENA, 256), 2).unwrap_err();
    assert!(
        matches!(
            empty,
            PlanError::StagingTooSmall {
                region: "prefill round buffer",
                need: 2,
                have: 0,
                ..
            }
        ),
        "{empty:?}"
    );
    let empty = plan(arena(SRC_ARENA, 64), arena(DST_ARENA, 0), 2).unwrap_err();
    assert!(
        matches!(
            empty,
            PlanError::StagingTooSmall {
                region: "decode round buffer",
                need: 8,
                have: 0,
                ..
            }
        ),
        "{empty:?}"
    );
    let wraps = plan(arena(u64::MAX - 4, 16), arena(DST_ARENA, 256), 2).unwrap_err();
    assert!(matches!(wraps, PlanError::Overflow { .. }), "{wraps:?}");
    // What the staged plan refuses, the rounds refuse naming plan_rounds.
    let delta = Request::new(&sp, &dp, Some(case.tokens)).skipping(5);
    let refused = RoundsPlanner::new(&template)
        .plan(&delta, arena(SRC_ARENA, 64), arena(DST_ARENA, 256), 2)
        .unwrap_err();
    assert!(
        matches!(
            refused,
            PlanError::Unsupported {
                planner: "plan_rounds",
                feature: "delta",
                ..
            }
        ),
        "{refused:?}"
    );
    // A slot request is no longer refused: its rounds move what its direct plan moves.
    let slot = Request::slot(1, 2);
    let rounds = RoundsPlanner::new(&template)
        .plan(&slot, arena(SRC_ARENA, 64), arena(DST_ARENA, 256), 2)
        .unwrap();
    assert_eq!(rounds.bytes, template.plan(&slot).unwrap().total_bytes);
}

/// The wire form is 64 bytes and refuses what no round is.
#[test]
fn manifests_survive_their_wire_form_and_refuse_garbage() {
    let m = RoundManifest {
        index: 2,
        n_rounds: 5,
        buffer: 0,
        n_network_blocks: 1,
        sender: (1, 4),
        offset: 1000,
        bytes: 500,
        total_bytes: 2300,
        dst_offset: 4096,
    };
    let wire = m.to_bytes();
    assert_eq!(wire.len(), 64);
    assert_eq!(&wire[..4], b"KVRM");
    assert_eq!(RoundManifest::from_bytes(&wire).unwrap(), m);
    assert_eq!(m.dst_bytes_range(), (4096, 4596));
    let refuse = |bytes: &[u8], says: &str| {
        let e = RoundManifest::from_bytes(bytes).unwrap_err();
        assert!(
            matches!(&e, PlanError::Wire { what } if what.contains(says)),
            "{e} should say {says}"
        );
    };
    refuse(&wire[..63], "64 bytes, got 63");
    let mut bad = wire;
    bad[0] = b'X';
    refuse(&bad, "KVRM");
    let mut bad = wire;
    bad[4] = 9;
    refuse(&bad, "version 9");
    let mut bad = wire;
    bad[8..12].copy_from_slice(&5u32.to_le_bytes());
    refuse(&bad, "round index 5 is not below the request's 5 rounds");
    let mut bad = wire;
    bad[28..32].copy_from_slice(&1u32.to_le_bytes());
    refuse(&bad, "sender 1 is not below the 1 senders");
    let mut bad = wire;
    bad[40..48].copy_from_slice(&1301u64.to_le_bytes());
    refuse(&bad, "reach past the request's 2300 bytes");
    let mut bad = wire;
    bad[56..64].copy_from_slice(&u64::MAX.to_le_bytes());
    refuse(&bad, "overflows");
}

/// An empty request plans no round; a block larger than the round buffer is split at byte
/// boundaries and no more (the rounds of a one-run MLA-like request: one block per entry).
#[test]
fn large_blocks_split_only_where_the_buffer_ends() {
    let case = Case {
        heads: 1,
        tp_p: 1,
        tp_d: 1,
        order: MemoryOrder::Nhd,
        pp_p: 1,
        page_sizes: (16, 16),
        tokens: 64,
        state: false,
        layers: 2,
    };
    let pair = Drawn {
        case,
        r_p: 0,
        r_d: 0,
        stage: 0,
    }
    .pair();
    let template = &pair.template;
    let rounds = check_rounds(&pair, 100, 2);
    // 2 layers × K, V of 64 tokens × 4 bytes, in rounds of at most 100 bytes.
    assert_eq!(rounds.bytes, 4 * 64 * 4);
    let none: [i64; 0] = [];
    let empty = RoundsPlanner::new(template)
        .plan(
            &Request::pages(&none, &none),
            arena(SRC_ARENA, 200),
            arena(DST_ARENA, 200),
            2,
        )
        .unwrap();
    assert!(empty.is_empty() && empty.bytes == 0, "{empty:?}");
    // A buffer of the whole request is one round with the staged plan's blocks.
    let whole = check_rounds(&pair, rounds.bytes, 1);
    assert_eq!(whole.len(), 1);
    let (sp, dp) = &pair.pages;
    let staged = StagedPlanner::new(template)
        .plan(
            &Request::pages(sp, dp),
            StagingRegion {
                addr: SRC_ARENA,
                size: 1 << 20,
            },
            StagingRegion {
                addr: DST_ARENA,
                size: 1 << 20,
            },
        )
        .unwrap();
    // Every round ends where a staged gather or scatter block ends, or fills its buffer.
    let ends = |p: &Plan| -> Vec<u64> {
        p.lengths
            .iter()
            .scan(0, |at, l| {
                *at += l;
                Some(*at)
            })
            .collect()
    };
    let (g, s) = (ends(&staged.gather), ends(&staged.scatter));
    for m in &rounds.manifests {
        let end = m.offset + m.bytes;
        assert!(
            m.bytes == 100 || g.contains(&end) || s.contains(&end),
            "{m:?} ends inside blocks {g:?} {s:?}"
        );
    }
    // A round splits a staged block only at its own ends: each stage of a round has at most
    // the staged blocks it overlaps.
    for k in 0..rounds.len() {
        let m = rounds.manifests[k];
        let overlapping = |e: &[u64]| {
            let starts = std::iter::once(0).chain(e.iter().copied());
            starts
                .zip(e.iter())
                .filter(|&(a, &b)| a < m.offset + m.bytes && b > m.offset)
                .count()
        };
        assert_eq!(rounds.gather.round(k).lengths.len(), overlapping(&g));
        assert_eq!(rounds.scatter.round(k).lengths.len(), overlapping(&s));
    }
    assert_eq!(rounds.len() as u64, rounds.bytes.div_ceil(100));
    assert_eq!(whole.gather.round(0).src_addrs, staged.gather.src_addrs);
    assert_eq!(whole.gather.round(0).dst_addrs, staged.gather.dst_addrs);
    assert_eq!(whole.scatter.round(0).dst_addrs, staged.scatter.dst_addrs);
}

/// The blocks of a plan as triples.
fn triples(plan: &Plan) -> Vec<(u64, u64, u64)> {
    (0..plan.lengths.len())
        .map(|k| (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]))
        .collect()
}

/// The blocks of every round of one stage as triples.
fn round_triples(blocks: &kvplan_core::RoundBlocks) -> Vec<(u64, u64, u64)> {
    (0..blocks.n_blocks)
        .map(|k| {
            (
                blocks.src_addrs()[k],
                blocks.dst_addrs()[k],
                blocks.lengths()[k],
            )
        })
        .collect()
}

/// One round buffer per arena and arenas equal to the staging regions of the unchunked staged
/// plan: the one round's gather is the staged gather block for block, and so are its network
/// and scatter under prefill PP 1. Under prefill PP the staged plan puts a stage's bytes in its
/// decode slots among the other stages' (the decode staging layout) while a rounds plan gives
/// every sender its own share of the arena, so the network and scatter differ: the two plans
/// are not one derivation with different buffers. Nor under PP 1 where the sender's share of
/// the arena starts elsewhere than the staged plan's writer share: the staged plan keeps one
/// share per staging writer (SGLang's layout) while rounds share the arena among the prefill
/// ranks that send (one elected holder of replicated heads: MLA TP 8 → 4's decode rank 1 is
/// sent by prefill rank 1, the only sender, whose staging writer share is the second). A round
/// keeps no pair ranges either (its blocks are one range per round).
#[test]
fn one_round_is_the_staged_plan_only_under_prefill_pp_1() {
    let mut rng = Lcg(0x5EED_0001);
    let (mut done, mut same, mut differ, mut elsewhere) = (0, 0, 0, 0);
    while done < examples() {
        let pair = next_pair(&mut rng);
        let (case, template, request) = (pair.drawn.case, &pair.template, pair.request());
        let whole = StagingRegion {
            addr: 0,
            size: u64::MAX,
        };
        let sizes = StagedPlanner::new(template)
            .plan(&request, whole, whole)
            .unwrap();
        if sizes.src_staging_bytes == 0 {
            continue; // a round buffer of no bytes is refused; the staged plan is empty
        }
        let (src_region, dst_region) = (
            arena(SRC_ARENA, sizes.src_staging_bytes),
            arena(DST_ARENA, sizes.dst_staging_bytes),
        );
        let staged = StagedPlanner::new(template)
            .plan(&request, src_region, dst_region)
            .unwrap();
        let rounds = RoundsPlanner::new(template)
            .plan(&request, src_region, dst_region, 1)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        assert_eq!(rounds.len(), 1, "{case:?}");
        assert_eq!(round_triples(&rounds.gather), triples(&staged.gather));
        let tail = (
            round_triples(&rounds.network) == triples(&staged.network),
            round_triples(&rounds.scatter) == triples(&staged.scatter),
        );
        if case.pp_p == 1 && rounds.dst_share.0 == staged.dst_staging_range.0 {
            assert_eq!(tail, (true, true), "{case:?}");
            same += 1;
        } else if case.pp_p == 1 {
            assert_eq!(tail, (false, false), "{case:?}");
            elsewhere += 1;
        } else {
            assert_eq!(tail, (false, false), "{case:?}");
            differ += 1;
        }
        done += 1;
    }
    assert!(
        same > 0 && differ > 0 && elsewhere > 0,
        "{same} {differ} {elsewhere}"
    );
}

/// One rank's MLA layout for `case` (one latent entry of `HEAD_BYTES` per token per layer, the
/// same on every rank).
fn mla_layout(case: &Case, side: Side, tp_rank: u32) -> Layout {
    let page_size = case.page_size(side);
    let item = page_size * HEAD_BYTES;
    let entry_len = item * case.capacity(side);
    let context = paged(page_size)
        .model_layers(u64::from(case.layers))
        .tp(tp_rank, side.pick(case.tp_p, case.tp_d));
    KvLayout::mla(
        side.pick(SRC_BASE, DST_BASE),
        (0..i64::from(case.layers)).collect::<Vec<_>>(),
        item,
        entry_len,
    )
    .spaced(entry_len + 64)
    .context(context)
    .build()
}

/// Head-sliced pairs: prefill TP 2 → decode TP 1 (each prefill rank fills its heads' half of
/// every decode page), TP 1 → 2 (each decode rank takes its half of every prefill page), TP
/// 4 → 1 and 2 → 4, heads outermost and tokens outermost, and MLA between the same sizes (the
/// latent whole on every rank). Whatever the round buffer (whole head slices, pieces of one,
/// a slice and a half), the rounds are as few as it allows (`ceil(bytes / buffer)`): a round
/// never ends a block short of full where that would take another round. Each round stays
/// within both sides' round buffers, and together they land the direct plan's bytes. With one
/// arena size on both sides (as a drop-in registers them), a round holds the smaller of the
/// prefill's `size / buffers` and the decode share's `size / (senders × buffers)`: the prefill
/// ranks writing one decode rank send at once, each into its own share, so a TP 2 → 1 round is
/// half the prefill's buffer by that contract, never fewer bytes. The latent published without
/// heads is whole on every prefill rank and sent by one per decode rank (`floor(r_d · tp_p /
/// tp_d)`), so its round is the prefill's whole buffer, and another rank's rounds are refused.
#[test]
fn head_sliced_rounds_are_as_few_as_the_round_buffer_allows() {
    let (mut planned, mut capped_by_share) = (0, 0);
    for mla in [false, true] {
        for order in [MemoryOrder::Hnd, MemoryOrder::Nhd] {
            for (tp_p, tp_d) in [(2, 1), (1, 2), (4, 1), (2, 4)] {
                let case = Case {
                    heads: if mla { 1 } else { 8 },
                    tp_p,
                    tp_d,
                    order,
                    pp_p: 1,
                    page_sizes: (16, 16),
                    tokens: 16 * 13,
                    state: false,
                    layers: 2,
                };
                // The bytes of one page's slice this pair moves: the heads both ranks hold.
                let shared = if mla { 1 } else { 8 / tp_p.max(tp_d) };
                let slice = 16 * u64::from(shared) * HEAD_BYTES;
                for (r_p, r_d) in (0..tp_p).flat_map(|p| (0..tp_d).map(move |d| (p, d))) {
                    let drawn = Drawn {
                        case,
                        r_p,
                        r_d,
                        stage: 0,
                    };
                    let pair = if mla {
                        let src = mla_layout(&case, Side::Src, r_p);
                        let dst = mla_layout(&case, Side::Dst, r_d);
                        let template =
                            Template::new(&src, &dst, TemplateOptions::default()).unwrap();
                        Pair {
                            drawn,
                            src,
                            dst,
                            template,
                            pages: (case.pages(Side::Src), case.pages(Side::Dst)),
                        }
                    } else {
                        drawn.pair()
                    };
                    let request = pair.request();
                    let bytes = StagedPlanner::new(&pair.template)
                        .counts(&request)
                        .unwrap()
                        .bytes;
                    if bytes == 0 {
                        continue; // ranks that share no heads
                    }
                    let what = format!("mla={mla} {order:?} TP {tp_p}->{tp_d} r_p={r_p} r_d={r_d}");
                    if mla && tp_p > tp_d && r_p != r_d * tp_p / tp_d {
                        // the latent published without heads moves whole, from one prefill
                        // rank per decode rank: another rank's rounds are refused, naming it
                        let err = RoundsPlanner::new(&pair.template)
                            .plan(&request, arena(SRC_ARENA, 64), arena(DST_ARENA, 64), 2)
                            .unwrap_err();
                        let sender = format!("sent by one, prefill rank {}", r_d * tp_p / tp_d);
                        assert!(
                            matches!(&err, PlanError::Geometry { what } if what.contains(&sender)),
                            "{what}: {err}"
                        );
                        continue;
                    }
                    let buffers = [
                        slice,
                        3 * slice,
                        8 * slice,
                        bytes + slice,
                        slice / 2 + 1,
                        3 * slice / 2,
                        5 * slice / 2 + 3,
                    ];
                    for buffer_bytes in buffers {
                        let rounds = check_rounds(&pair, buffer_bytes, 2);
                        assert_eq!(
                            rounds.len() as u64,
                            bytes.div_ceil(buffer_bytes),
                            "{what} buffer={buffer_bytes}"
                        );
                        planned += 1;
                    }
                    let size = 64 * slice;
                    // every prefill rank of the decode rank's heads; the latent's one
                    let senders = u64::from(if mla { 1 } else { (tp_p / tp_d).max(1) });
                    let rounds = RoundsPlanner::new(&pair.template)
                        .plan(&request, arena(SRC_ARENA, size), arena(DST_ARENA, size), 2)
                        .unwrap();
                    assert_eq!(rounds.buffer_bytes, size / (2 * senders), "{what}");
                    assert_eq!(
                        rounds.len() as u64,
                        bytes.div_ceil(rounds.buffer_bytes),
                        "{what}"
                    );
                    for manifest in &rounds.manifests {
                        assert!(manifest.bytes <= rounds.buffer_bytes, "{what}");
                    }
                    assert_eq!(
                        rounds.manifests.iter().map(|m| m.bytes).sum::<u64>(),
                        pair.template.plan(&request).unwrap().total_bytes,
                        "{what}"
                    );
                    capped_by_share += usize::from(senders > 1);
                }
            }
        }
    }
    assert!(
        planned > 0 && capped_by_share > 0,
        "{planned} {capped_by_share}"
    );
}

/// One rank's MLA layout publishing its attention geometry (one latent head, `kv_heads = 1`,
/// on every rank), with stage `stage`'s layers of `case.pp_p` on the prefill side.
fn mla_sliced_layout(case: &Case, side: Side, tp_rank: u32, stage: u32) -> Layout {
    let page_size = case.page_size(side);
    let item = page_size * HEAD_BYTES;
    let entry_len = item * case.capacity(side);
    let pp = side.pick(case.pp_p, 1);
    let per_stage = case.layers / pp;
    let context = paged(page_size)
        .model_layers(u64::from(case.layers))
        .pp(stage, pp)
        .tp(tp_rank, side.pick(case.tp_p, case.tp_d))
        .attention(heads(1, 1, case.order));
    KvLayout::mla(
        side.pick(SRC_BASE, DST_BASE),
        (stage * per_stage..(stage + 1) * per_stage).map(i64::from),
        item,
        entry_len,
    )
    .spaced(entry_len + 64)
    .context(context)
    .build()
}

/// The decode arena is split among the prefill ranks the template's head slicing actually
/// sends from, not among every prefill rank of the decode rank's staging region: MLA TP 2 → 1
/// and 4 → 1 (vLLM's NIXL read: one elected holder of the latent sends, so it owns the whole
/// arena and takes half, a quarter, of the rounds a writer share would), MLA TP 4 → 2 (decode
/// rank 1's latent comes from prefill rank 1, not from its staging writers 2 and 3), 2 KV heads
/// over TP 4 → 1 (ranks 0 and 2 send), 8 heads over TP 2 → 1 (both send, as before), prefill
/// PP 2 (one share per stage of each sender), and with `replicas_send` every writer (as
/// before). A rank that sends nothing plans no round, owns no share and is no error. Each
/// sender's round buffer is its whole share of the arena (`size / (senders × buffers)`), the
/// rounds as few as that buffer allows, and the senders' shares tile the arena.
#[test]
fn decode_arena_shares_follow_the_head_slicing() {
    // (what, kv heads (0: MLA), TP prefill → decode, prefill PP, replicas_send, decode rank,
    //  each prefill rank's position among the senders, senders)
    type Want = (
        &'static str,
        u32,
        (u32, u32),
        u32,
        bool,
        u32,
        &'static [Option<u32>],
        u32,
    );
    let cases: [Want; 9] = [
        ("MLA 2->1", 0, (2, 1), 1, false, 0, &[Some(0), None], 1),
        (
            "MLA 4->1",
            0,
            (4, 1),
            1,
            false,
            0,
            &[Some(0), None, None, None],
            1,
        ),
        (
            "MLA 4->2",
            0,
            (4, 2),
            1,
            false,
            1,
            &[None, Some(0), None, None],
            1,
        ),
        (
            "GQA H=2 4->1",
            2,
            (4, 1),
            1,
            false,
            0,
            &[Some(0), None, Some(1), None],
            2,
        ),
        (
            "GQA H=8 2->1",
            8,
            (2, 1),
            1,
            false,
            0,
            &[Some(0), Some(1)],
            2,
        ),
        ("MLA 2->1 PP 2", 0, (2, 1), 2, false, 0, &[Some(0), None], 1),
        (
            "GQA H=2 4->1 PP 2",
            2,
            (4, 1),
            2,
            false,
            0,
            &[Some(0), None, Some(1), None],
            2,
        ),
        (
            "MLA 2->1 replicas_send",
            0,
            (2, 1),
            1,
            true,
            0,
            &[Some(0), Some(1)],
            2,
        ),
        (
            "GQA H=2 4->1 replicas_send",
            2,
            (4, 1),
            1,
            true,
            0,
            &[Some(0), Some(1), Some(2), Some(3)],
            4,
        ),
    ];
    let buffers = 2u32;
    for (what, kv_heads, (tp_p, tp_d), pp_p, replicas_send, r_d, want, count) in cases {
        let case = Case {
            heads: kv_heads.max(1),
            tp_p,
            tp_d,
            order: MemoryOrder::Hnd,
            pp_p,
            page_sizes: (16, 16),
            tokens: 16 * 12,
            state: false,
            layers: 4,
        };
        let build = |side: Side, rank: u32, stage: u32| {
            if kv_heads == 0 {
                mla_sliced_layout(&case, side, rank, stage)
            } else {
                layout(&case, side, rank, stage)
            }
        };
        let options = TemplateOptions {
            replicas_send,
            ..TemplateOptions::default()
        };
        let dst = build(Side::Dst, r_d, 0);
        let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
        let request = Request::pages(&sp, &dp);
        let senders = count * pp_p;
        // Round buffers of 64 bytes per sender share; the prefill's buffers hold more.
        let dst_size = 64 * u64::from(buffers * senders);
        let src_size = 1 << 20;
        let mut shares = Vec::new();
        for r_p in 0..tp_p {
            for stage in 0..pp_p {
                let src = build(Side::Src, r_p, stage);
                let template = Template::new(&src, &dst, options).unwrap();
                let direct = template.plan(&request).unwrap();
                let rounds = RoundsPlanner::new(&template)
                    .plan(
                        &request,
                        arena(SRC_ARENA, src_size),
                        arena(DST_ARENA, dst_size),
                        buffers,
                    )
                    .unwrap_or_else(|e| panic!("{what} r_p={r_p} stage={stage}: {e}"));
                let at = format!("{what} r_p={r_p} stage={stage}");
                assert_eq!(rounds.bytes, direct.total_bytes, "{at}");
                if let Some(position) = want[r_p as usize] {
                    let index = position * pp_p + stage;
                    assert_eq!(rounds.sender, (index, senders), "{at}");
                    // the whole arena over the senders' buffers
                    assert_eq!(
                        rounds.buffer_bytes,
                        dst_size / u64::from(senders * buffers),
                        "{at}"
                    );
                    assert!(rounds.bytes > 0, "{at}");
                    assert_eq!(
                        rounds.len() as u64,
                        rounds.bytes.div_ceil(rounds.buffer_bytes),
                        "{at}"
                    );
                    let share = dst_size / u64::from(senders);
                    assert_eq!(
                        rounds.dst_share,
                        (u64::from(index) * share, u64::from(index + 1) * share),
                        "{at}"
                    );
                    for m in &rounds.manifests {
                        let (lo, hi) = m.dst_bytes_range();
                        assert!(rounds.dst_share.0 <= lo && hi <= rounds.dst_share.1);
                        assert_eq!(m.sender, (index, senders), "{at}");
                    }
                    shares.push(rounds.dst_share);
                } else {
                    assert_eq!(direct.total_bytes, 0, "{at}");
                    assert!(rounds.is_empty(), "{at}");
                    assert_eq!(rounds.sender, (0, senders), "{at}");
                    assert_eq!(rounds.dst_share, (0, 0), "{at}");
                }
            }
        }
        shares.sort_unstable();
        assert_eq!(shares.len() as u32, senders, "{what}");
        assert_eq!(shares[0].0, 0, "{what}");
        assert_eq!(shares.last().unwrap().1, dst_size, "{what}");
        assert!(shares.windows(2).all(|w| w[0].1 == w[1].0), "{what}");
    }
    // The latent published without heads (as vLLM's NIXL connector registers MLA): one prefill
    // rank per decode rank sends it, floor(r_d · tp_p / tp_d) (vLLM's MLA read), owning the
    // whole arena; another rank's rounds are refused; with replicas_send every writer sends.
    for ((tp_p, tp_d), r_d, sender) in [((2, 1), 0, 0), ((4, 1), 0, 0), ((4, 2), 1, 2)] {
        let case = Case {
            heads: 1,
            tp_p,
            tp_d,
            order: MemoryOrder::Hnd,
            pp_p: 1,
            page_sizes: (16, 16),
            tokens: 16 * 12,
            state: false,
            layers: 4,
        };
        let (sp, dp) = (case.pages(Side::Src), case.pages(Side::Dst));
        let request = Request::pages(&sp, &dp);
        let dst = mla_layout(&case, Side::Dst, r_d);
        let dst_size = 64 * u64::from(buffers * tp_p / tp_d);
        for r_p in 0..tp_p {
            let src = mla_layout(&case, Side::Src, r_p);
            for replicas_send in [false, true] {
                let options = TemplateOptions {
                    replicas_send,
                    ..TemplateOptions::default()
                };
                let template = Template::new(&src, &dst, options).unwrap();
                assert!(template.head_slicing().is_none());
                let at = format!("whole latent {tp_p}->{tp_d} r_p={r_p} {replicas_send}");
                let planned = RoundsPlanner::new(&template).plan(
                    &request,
                    arena(SRC_ARENA, 1 << 20),
                    arena(DST_ARENA, dst_size),
                    buffers,
                );
                let writers = tp_p / tp_d;
                if replicas_send && r_p / writers == r_d {
                    let rounds = planned.unwrap();
                    assert_eq!(rounds.sender, (r_p % writers, writers), "{at}");
                    assert_eq!(rounds.buffer_bytes, 64, "{at}");
                } else if r_p == sender && !replicas_send {
                    let rounds = planned.unwrap();
                    assert_eq!(rounds.sender, (0, 1), "{at}");
                    assert_eq!(rounds.dst_share, (0, dst_size), "{at}");
                    assert_eq!(rounds.buffer_bytes, dst_size / u64::from(buffers), "{at}");
                    assert_eq!(
                        rounds.len() as u64,
                        rounds.bytes.div_ceil(rounds.buffer_bytes),
                        "{at}"
                    );
                } else if !replicas_send {
                    let err = planned.unwrap_err();
                    let named = format!("sent by one, prefill rank {sender}");
                    assert!(
                        matches!(&err, PlanError::Geometry { what } if what.contains(&named)),
                        "{at}: {err}"
                    );
                }
            }
        }
    }
}
