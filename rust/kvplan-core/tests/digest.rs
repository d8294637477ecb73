//! Plan and content digests: the documented byte encodings (re-implemented here from the
//! module documentation), pinned test vectors, and the bounds every block must respect.

mod support;

use kvplan_core::Request;
use kvplan_core::exchange::digest::{
    CHUNK_BYTES, CONTENT_DIGEST_TAG, LEASE_DIGEST_TAG, PLAN_DIGEST_TAG, leased_plan_digest,
    pair_content_digests_on,
};
use kvplan_core::{
    Layout, LayoutContext, PlanBlocks, PlanError, Region, Side, Template, TemplateOptions,
    content_digest, index_digest, layout_fingerprint, pair_content_digests, plan_digest,
};
use support::layouts::{ContextBuilder, KvLayout};
use xxhash_rust::xxh3::xxh3_64;

const SRC_BASE: u64 = 0x1000_0000;
const DST_BASE: u64 = 0x2000_0000;
const ITEM: u64 = 64;
const PAGES: u64 = 16;
const LAYERS: u64 = 2;

/// Two MLA layers, buffers back to back from `base`, 16 pages of 64 bytes each.
fn layout(base: u64, pp_size: u32) -> Layout {
    KvLayout::mla(base, 0..LAYERS as i64, ITEM, ITEM * PAGES)
        .context(LayoutContext::default().pp(0, pp_size))
        .build()
}

struct Fixture {
    src: Layout,
    dst: Layout,
    plan: kvplan_core::Plan,
    offsets: Vec<usize>,
}

impl Fixture {
    fn new() -> Self {
        let (src, dst) = (layout(SRC_BASE, 1), layout(DST_BASE, 1));
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        // Three runs: [0, 1] -> [3, 4], 2 -> 7, 5 -> 8.
        let plan = template
            .plan(&Request::pages(&[0i64, 1, 2, 5], &[3i64, 4, 7, 8]))
            .unwrap();
        assert_eq!((plan.n_runs, plan.lengths.len()), (3, 6));
        // Uncoalesced packed buffers: pair p owns blocks p * runs .. (p + 1) * runs.
        let offsets = (0..=LAYERS as usize).map(|p| p * plan.n_runs).collect();
        Self {
            src,
            dst,
            plan,
            offsets,
        }
    }

    fn blocks(&self) -> PlanBlocks<'_> {
        PlanBlocks {
            src_addrs: &self.plan.src_addrs,
            dst_addrs: &self.plan.dst_addrs,
            lengths: &self.plan.lengths,
            pair_offsets: &self.offsets,
        }
    }

    fn fingerprints(&self) -> (u64, u64) {
        (
            layout_fingerprint(&self.src).unwrap(),
            layout_fingerprint(&self.dst).unwrap(),
        )
    }
}

/// Deterministic contents for a side's memory.
fn memory(seed: u8) -> Vec<u8> {
    (0..LAYERS * ITEM * PAGES)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed)
        .collect()
}

/// Copies every planned block from `src` memory into `dst` memory, as an engine would.
fn transfer(blocks: &PlanBlocks<'_>, src: &[u8], dst: &mut [u8]) {
    for b in 0..blocks.lengths.len() {
        let s = (blocks.src_addrs[b] - SRC_BASE) as usize;
        let d = (blocks.dst_addrs[b] - DST_BASE) as usize;
        let n = blocks.lengths[b] as usize;
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
}

fn le(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn xxh3_is_the_reference_function() {
    // XXH3_64bits("") of the reference implementation: a pair owning no block hashes to it.
    assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
    let blocks = PlanBlocks {
        src_addrs: &[],
        dst_addrs: &[],
        lengths: &[],
        pair_offsets: &[0, 0],
    };
    let digests = pair_content_digests(&blocks, Side::Src, &[]).unwrap();
    assert_eq!(digests, vec![0x2d06_8005_38d3_94c2]);
}

#[test]
fn fingerprint_is_xxh3_of_the_wire_bytes() {
    let f = Fixture::new();
    let wire = kvplan_core::exchange::wire::encode(&f.src).unwrap();
    assert_eq!(layout_fingerprint(&f.src).unwrap(), xxh3_64(&wire));
    // Any field the handshake carries changes it: here the PP size.
    assert_ne!(
        layout_fingerprint(&f.src).unwrap(),
        layout_fingerprint(&layout(SRC_BASE, 2)).unwrap()
    );
}

#[test]
fn plan_digest_follows_the_documented_encoding() {
    let f = Fixture::new();
    let (fs, fd) = f.fingerprints();
    let mut input = PLAN_DIGEST_TAG.to_vec();
    input.extend(le(&[fs, fd, LAYERS]));
    input.extend(le(&f.offsets.iter().map(|&o| o as u64).collect::<Vec<_>>()));
    input.extend(le(&[f.plan.lengths.len() as u64]));
    input.extend(le(&f.plan.src_addrs));
    input.extend(le(&f.plan.dst_addrs));
    input.extend(le(&f.plan.lengths));
    assert_eq!(plan_digest((fs, fd), &f.blocks()).unwrap(), xxh3_64(&input));
}

#[test]
fn leased_digest_follows_the_documented_encoding_and_binds_both_lease_fields() {
    let mut input = LEASE_DIGEST_TAG.to_vec();
    input.extend(le(&[0xe8f6_aeb4_20e5_d22f, 7, 5]));
    input.extend(b"req-A");
    let leased = leased_plan_digest(0xe8f6_aeb4_20e5_d22f, 7, b"req-A");
    assert_eq!(leased, xxh3_64(&input));
    assert_ne!(
        leased,
        leased_plan_digest(0xe8f6_aeb4_20e5_d22f, 8, b"req-A"),
        "epoch"
    );
    assert_ne!(
        leased,
        leased_plan_digest(0xe8f6_aeb4_20e5_d22f, 7, b"req-B"),
        "request"
    );
    assert_ne!(
        leased,
        leased_plan_digest(0xe8f6_aeb4_20e5_d22e, 7, b"req-A"),
        "plan"
    );
    // The length prefix keeps (epoch, id) pairs apart whose concatenations would collide.
    assert_ne!(
        leased_plan_digest(1, 7, b""),
        leased_plan_digest(1, 7, b"\0")
    );
}

#[test]
fn content_digest_follows_the_documented_encoding() {
    let f = Fixture::new();
    let src = memory(7);
    let regions = [Region {
        base: SRC_BASE,
        bytes: &src,
    }];
    let pairs = pair_content_digests(&f.blocks(), Side::Src, &regions).unwrap();
    let blocks = f.blocks();
    for (p, &digest) in pairs.iter().enumerate() {
        let chunk_hashes: Vec<u64> = (blocks.pair_offsets[p]..blocks.pair_offsets[p + 1])
            .map(|b| {
                let s = (blocks.src_addrs[b] - SRC_BASE) as usize;
                xxh3_64(&src[s..s + blocks.lengths[b] as usize])
            })
            .collect();
        assert_eq!(digest, xxh3_64(&le(&chunk_hashes)), "pair {p}");
    }
    let mut input = CONTENT_DIGEST_TAG.to_vec();
    input.extend(le(&[pairs.len() as u64]));
    input.extend(le(&pairs));
    assert_eq!(content_digest(&pairs), xxh3_64(&input));
}

#[test]
fn long_blocks_are_hashed_in_chunks() {
    let len = 2 * CHUNK_BYTES + 100;
    let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let blocks = PlanBlocks {
        src_addrs: &[SRC_BASE],
        dst_addrs: &[DST_BASE],
        lengths: &[len as u64],
        pair_offsets: &[0, 1],
    };
    let regions = [Region {
        base: SRC_BASE,
        bytes: &bytes,
    }];
    let chunks: Vec<u64> = bytes.chunks(CHUNK_BYTES).map(xxh3_64).collect();
    assert_eq!(chunks.len(), 3);
    assert_eq!(
        pair_content_digests(&blocks, Side::Src, &regions).unwrap(),
        vec![xxh3_64(&le(&chunks))]
    );
}

/// Pinned values: a change here changes what peers of different builds compute, so it needs
/// a new version tag, not a new constant.
#[test]
fn test_vectors() {
    let f = Fixture::new();
    let (fs, fd) = f.fingerprints();
    assert_eq!(
        (fs, fd),
        (0x0ce8_623b_a9b6_f615, 0x7b8e_186a_5319_8e68),
        "fingerprints"
    );
    assert_eq!(
        plan_digest((fs, fd), &f.blocks()).unwrap(),
        0xe8f6_aeb4_20e5_d22f,
        "plan digest"
    );
    let src = memory(7);
    let regions = [Region {
        base: SRC_BASE,
        bytes: &src,
    }];
    let pairs = pair_content_digests(&f.blocks(), Side::Src, &regions).unwrap();
    assert_eq!(
        pairs,
        vec![0x8fe4_2031_24bd_9618, 0x15b6_756c_ad4e_bef5],
        "pair digests"
    );
    assert_eq!(
        content_digest(&pairs),
        0x15b2_7916_ba5a_8cbd,
        "content digest"
    );
    assert_eq!(
        index_digest(&[0i64, 1, 2, 5]),
        0xecc9_e00e_1ccb_e819,
        "index digest"
    );
    assert_eq!(
        index_digest(&[0i32, 1, 2, 5]),
        index_digest(&[0i64, 1, 2, 5])
    );
    assert_eq!(
        leased_plan_digest(0xe8f6_aeb4_20e5_d22f, 7, b"req-A"),
        0xcc7e_f59d_dae6_b14a,
        "leased plan digest"
    );
}

#[test]
fn a_transfer_agrees_and_a_flipped_byte_names_its_pair() {
    let f = Fixture::new();
    let blocks = f.blocks();
    let src = memory(7);
    let mut dst = memory(99);
    transfer(&blocks, &src, &mut dst);
    let src_regions = [Region {
        base: SRC_BASE,
        bytes: &src,
    }];
    let sent = pair_content_digests(&blocks, Side::Src, &src_regions).unwrap();
    let landed = |dst: &[u8]| {
        let regions = [Region {
            base: DST_BASE,
            bytes: dst,
        }];
        pair_content_digests(&blocks, Side::Dst, &regions).unwrap()
    };
    assert_eq!(landed(&dst), sent);
    // A byte of layer 1's last block.
    let last = blocks.lengths.len() - 1;
    dst[(blocks.dst_addrs[last] - DST_BASE) as usize + 5] ^= 0x10;
    let after = landed(&dst);
    assert_eq!(after[0], sent[0]);
    assert_ne!(after[1], sent[1]);
    assert_ne!(content_digest(&after), content_digest(&sent));
    // Bytes outside the plan do not count: page 0 of the destination is never written.
    dst[(blocks.dst_addrs[last] - DST_BASE) as usize + 5] ^= 0x10;
    dst[0] ^= 0xff;
    assert_eq!(landed(&dst), sent);
}

#[test]
fn blocks_outside_every_buffer_are_named() {
    let f = Fixture::new();
    let src = memory(7);
    // The buffer ends one byte short of the last block.
    let short = Region {
        base: SRC_BASE,
        bytes: &src[..src.len() - 1 - (ITEM * PAGES - 6 * ITEM) as usize],
    };
    let err = pair_content_digests(&f.blocks(), Side::Src, &[short]).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::BlockOutsideBuffers {
                block: 5,
                side: Side::Src,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("src block 5"), "{text}");
    assert!(text.contains("nearest is buffer 0"), "{text}");
    // Two adjacent buffers: a block across their boundary is refused, not read across.
    let (a, b) = src.split_at((ITEM * PAGES) as usize + 32);
    let split = [
        Region {
            base: SRC_BASE,
            bytes: a,
        },
        Region {
            base: SRC_BASE + a.len() as u64,
            bytes: b,
        },
    ];
    let err = pair_content_digests(&f.blocks(), Side::Src, &split).unwrap_err();
    assert!(
        matches!(err, PlanError::BlockOutsideBuffers { block: 3, .. }),
        "{err}"
    );
    let err = pair_content_digests(&f.blocks(), Side::Dst, &[]).unwrap_err();
    assert!(err.to_string().contains("no buffers were given"), "{err}");
}

#[test]
fn malformed_inputs_are_errors() {
    let bad_offsets = PlanBlocks {
        src_addrs: &[1, 2],
        dst_addrs: &[1, 2],
        lengths: &[1, 1],
        pair_offsets: &[0, 1],
    };
    let err = plan_digest((0, 0), &bad_offsets).unwrap_err();
    assert!(matches!(err, PlanError::DigestInput { .. }), "{err}");
    let bad_columns = PlanBlocks {
        src_addrs: &[1],
        dst_addrs: &[1, 2],
        lengths: &[1, 1],
        pair_offsets: &[0, 2],
    };
    let err = pair_content_digests(&bad_columns, Side::Src, &[]).unwrap_err();
    assert!(err.to_string().contains("unequal lengths"), "{err}");
}

/// Chunks hashed on several threads give the documented value (the chunk hashes of each pair's
/// blocks in plan order) for any thread count, across blocks of every size: empty, shorter than
/// a chunk, several chunks long, and pairs owning no block.
#[test]
fn the_thread_count_never_changes_the_digest() {
    let lengths: Vec<u64> = [
        0,
        7,
        CHUNK_BYTES + 1,
        3 * CHUNK_BYTES,
        0,
        65,
        2 * CHUNK_BYTES - 1,
        1,
    ]
    .iter()
    .map(|&n| n as u64)
    .collect();
    let mut at = SRC_BASE;
    let src_addrs: Vec<u64> = lengths
        .iter()
        .map(|&n| {
            let a = at;
            at += n + 3;
            a
        })
        .collect();
    let bytes: Vec<u8> = (0..at - SRC_BASE).map(|i| (i * 7 % 253) as u8).collect();
    let blocks = PlanBlocks {
        src_addrs: &src_addrs,
        dst_addrs: &src_addrs,
        lengths: &lengths,
        pair_offsets: &[0, 3, 3, 6, 8],
    };
    let regions = [Region {
        base: SRC_BASE,
        bytes: &bytes,
    }];
    let expected: Vec<u64> = blocks
        .pair_offsets
        .windows(2)
        .map(|w| {
            let chunks: Vec<u64> = (w[0]..w[1])
                .flat_map(|b| {
                    let s = (src_addrs[b] - SRC_BASE) as usize;
                    bytes[s..s + lengths[b] as usize]
                        .chunks(CHUNK_BYTES)
                        .map(xxh3_64)
                })
                .collect();
            xxh3_64(&le(&chunks))
        })
        .collect();
    for threads in [0, 1, 2, 3, 4, 7, 8, 64] {
        assert_eq!(
            pair_content_digests_on(&blocks, Side::Src, &regions, threads).unwrap(),
            expected,
            "{threads} threads"
        );
    }
    assert_eq!(
        pair_content_digests(&blocks, Side::Src, &regions).unwrap(),
        expected
    );
}
