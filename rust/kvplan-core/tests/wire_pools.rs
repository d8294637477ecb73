//! The wire form of layouts with pools of their own: every further pool (id, page size, tokens
//! per row) and each entry's pool round-trip; the encodings of layouts without them are the
//! bytes earlier builds wrote; a damaged pool table or membership is a typed wire error naming
//! the field.

use kvplan_core::exchange::wire::{
    EXT_POOL, EXT_POOLS, EXT_WINDOW_POOL, POOL_RECORD_LEN, crc32, decode, encode,
};
use kvplan_core::rules::dcp::DcpContext;
use kvplan_core::{Layout, LayoutContext, PlanError, Pool, PoolId};
use proptest::prelude::*;

const TRAILER: usize = 4;

/// MLA layers of 64-byte items over 4-token pages, `n` entries, the first holding `pages`.
fn base(n: usize, pages: u64) -> Layout {
    let ctx = LayoutContext {
        page_size: 4,
        num_model_layers: Some(n as u64),
        ..LayoutContext::default()
    };
    Layout::mla(
        (0..n as u64).map(|i| (1 << 30) + (i << 24)).collect(),
        vec![64 * pages; n],
        vec![64; n],
        Some((0..n as i64).collect()),
        ctx,
    )
    .unwrap()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|k| u8::from_str_radix(&text[k..k + 2], 16).unwrap())
        .collect()
}

/// Layouts whose encodings predate the pool table: plain, windows in a window pool (with a
/// state ring), and a DCP context.
fn old_forms() -> Vec<Layout> {
    let windowed = base(3, 16)
        .with_state("mamba", vec![1 << 40], vec![4 * 96], vec![96], vec![3])
        .unwrap()
        .with_windows_in_pool(vec![None, Some(8), Some(8), None], Some(2))
        .unwrap()
        .with_rings(vec![None, None, None, Some(4)])
        .unwrap();
    let mut ctx = base(1, 8).context().clone();
    ctx.dcp = DcpContext {
        size: 2,
        rank: 1,
        interleave: 4,
    };
    let dealt = Layout::mla(vec![4096], vec![64 * 8], vec![64], Some(vec![0]), ctx).unwrap();
    vec![base(2, 8), windowed, dealt]
}

/// The encodings of [`old_forms`] as this format wrote them before it carried pool tables.
const GOLDEN: [&str; 3] = [
    "4b56504c02000000020000000400000000000000020000000000000000000000010000000000000001000000030063707500000000004000000000000200000000000040000000000000004000000000000000000001000000000000000002006b7600000000004100000000000200000000000040000000000000004000000000000000000001010000000000000002006b760000bcbef4e3",
    "4b56504c02000000040000000400000000000000030000000000000000000000010000000000000001000000030063707501000580080002000000000000000000004000000000000400000000000040000000000000004000000000000000000001000000000000000002006b7600000000004100000000000400000000000040000000000000004000000000000000000001010000000000000002006b7601000380080008000000000000000000004200000000000400000000000040000000000000004000000000000000000001020000000000000002006b7601000380080008000000000000000000000000010000800100000000000060000000000000006000000000000000010001030000000000000005006d616d626101000480080004000000000000005cf47501",
    "4b56504c020000000100000004000000000000000100000000000000000000000100000000000000010000000300637075010002801000020000000100000004000000000000000010000000000000000200000000000040000000000000004000000000000000000001000000000000000002006b76000005c91020",
];

#[test]
fn layouts_without_a_pool_table_encode_and_decode_as_before() {
    for (layout, golden) in old_forms().iter().zip(GOLDEN) {
        let bytes = unhex(golden);
        assert_eq!(hex(&encode(layout).unwrap()), golden);
        assert_eq!(&decode(&bytes).unwrap(), layout);
    }
}

/// `bytes` with its trailer recomputed after `edit` changed the body.
fn reseal(bytes: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut body = bytes[..bytes.len() - TRAILER].to_vec();
    edit(&mut body);
    let crc = crc32(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    body
}

/// Where the extension `tag` of `len` payload bytes starts in `bytes`.
fn find_ext(bytes: &[u8], tag: u16, len: u16) -> usize {
    let mut needle = tag.to_le_bytes().to_vec();
    needle.extend_from_slice(&len.to_le_bytes());
    bytes
        .windows(4)
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("no extension {tag:#06x} of {len} bytes"))
}

/// Four MLA layers, entries 1 and 3 in pool 1 (8-token pages of 4-token rows), entry 2 in
/// pool 2 (16-token pages).
fn pooled() -> Layout {
    base(4, 16)
        .with_pool(&[1, 3], 8, 4)
        .unwrap()
        .with_pool(&[2], 16, 1)
        .unwrap()
}

fn wire_err(data: &[u8]) -> String {
    match decode(data) {
        Err(err @ PlanError::Wire { .. }) => err.to_string(),
        other => panic!("expected a wire error, got {other:?}"),
    }
}

#[test]
fn further_pools_round_trip_as_a_pool_table_and_entry_pools() {
    let layout = pooled();
    let bytes = encode(&layout).unwrap();
    let back = decode(&bytes).unwrap();
    assert_eq!(back, layout);
    assert_eq!(
        back.pools()[1..],
        [
            Pool {
                id: PoolId(1),
                page_size: 8,
                tokens_per_row: 4
            },
            Pool {
                id: PoolId(2),
                page_size: 16,
                tokens_per_row: 1
            }
        ]
    );
    assert_eq!(
        (0..4).map(|i| back.entry(i).pool()).collect::<Vec<_>>(),
        [0, 1, 2, 1].map(|p| Some(PoolId(p)))
    );
    // The table: two 17-byte records; entries 1 to 3 each name their pool.
    let at = find_ext(&bytes, EXT_POOLS, 2 * POOL_RECORD_LEN as u16);
    assert_eq!(bytes[at + 4], 1);
    assert_eq!(bytes[at + 4 + POOL_RECORD_LEN], 2);
    assert_eq!(
        bytes
            .windows(5)
            .filter(|w| w[..4] == [0x08, 0x80, 1, 0])
            .map(|w| w[4])
            .collect::<Vec<_>>(),
        [1, 2, 1]
    );
}

#[test]
fn a_window_pool_made_after_a_further_pool_keeps_its_id() {
    // Pool 1 is a further pool, the window pool is pool 2: the window pool tag would put the
    // window entries in pool 1, so the table carries both.
    let layout = base(3, 16)
        .with_pool(&[0], 8, 2)
        .unwrap()
        .with_windows(vec![None, Some(8), None])
        .unwrap()
        .with_window_pool(4)
        .unwrap();
    assert_eq!(layout.window_pool().unwrap().id, PoolId(2));
    let bytes = encode(&layout).unwrap();
    assert!(!bytes.windows(2).any(|w| w == EXT_WINDOW_POOL.to_le_bytes()));
    assert_eq!(decode(&bytes).unwrap(), layout);
}

#[test]
fn a_damaged_pool_table_or_entry_pool_is_a_wire_error_naming_the_field() {
    let bytes = encode(&pooled()).unwrap();
    let table = find_ext(&bytes, EXT_POOLS, 2 * POOL_RECORD_LEN as u16);
    // A table one byte short (length and payload agree, so the record count is what is wrong).
    let short = reseal(&bytes, |b| {
        b[table + 2] -= 1;
        b.remove(table + 4);
    });
    assert!(
        wire_err(&short).contains(
            "a pool table extension holds 33 bytes; it must hold 1 to 7 \
                                   records of 17 bytes"
        ),
        "{}",
        wire_err(&short)
    );
    let empty = reseal(&bytes, |b| {
        b[table + 2] = 0;
        b.drain(table + 4..table + 4 + 2 * POOL_RECORD_LEN);
    });
    assert!(wire_err(&empty).contains("holds 0 bytes"));
    // Records out of order.
    let swapped = reseal(&bytes, |b| b[table + 4] = 2);
    assert!(
        wire_err(&swapped).contains("pool table record 0 has id 2"),
        "{}",
        wire_err(&swapped)
    );
    // A page size of 0: the layout's own check names the pool and the value.
    let zero = reseal(&bytes, |b| b[table + 5..table + 13].fill(0));
    let err = decode(&zero).unwrap_err();
    assert!(matches!(err, PlanError::InvalidLayout { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("pool 1: page_size and tokens_per_row must be at least 1, got page_size 0"),
        "{err}"
    );
    // An entry naming a pool the table does not hold, or pool 0.
    let member = find_ext(&bytes, EXT_POOL, 1);
    for (id, what) in [
        (
            3u8,
            "entry 1: pool id 3 is not a pool of the table (ids 1 to 2",
        ),
        (0, "entry 1: pool id 0 is not a pool of the table"),
    ] {
        let bad = reseal(&bytes, |b| b[member + 4] = id);
        assert!(wire_err(&bad).contains(what), "{}", wire_err(&bad));
    }
    // An entry pool of two bytes.
    let wide = reseal(&bytes, |b| {
        b[member + 2] = 2;
        b.insert(member + 5, 0);
    });
    assert!(
        wire_err(&wide).contains("entry 1: a pool extension holds 2 bytes; it must hold 1"),
        "{}",
        wire_err(&wide)
    );
    // Every truncation and every bit flip is refused.
    for cut in 0..bytes.len() {
        assert!(
            decode(&bytes[..cut]).is_err(),
            "truncation at {cut} accepted"
        );
    }
    for i in 0..bytes.len() {
        let mut flipped = bytes.clone();
        flipped[i] ^= 0x10;
        assert!(decode(&flipped).is_err(), "bit flip at {i} accepted");
    }
}

#[test]
fn an_entry_pool_without_a_table_and_a_table_beside_a_window_pool_are_malformed() {
    // Drop the table from the context's list: the entries' pools then name nothing.
    let bytes = encode(&pooled()).unwrap();
    let table = find_ext(&bytes, EXT_POOLS, 2 * POOL_RECORD_LEN as u16);
    let orphan = reseal(&bytes, |b| {
        b.drain(table..table + 4 + 2 * POOL_RECORD_LEN);
        b[table - 2] -= 1;
    });
    assert!(
        wire_err(&orphan).contains(
            "entry 1 carries a pool extension (0x8008) but the context carries no pool table (0x8007)"
        ),
        "{}",
        wire_err(&orphan)
    );
    // A window pool tag beside the table.
    let both = reseal(&bytes, |b| {
        let mut ext = EXT_WINDOW_POOL.to_le_bytes().to_vec();
        ext.extend_from_slice(&8u16.to_le_bytes());
        ext.extend_from_slice(&4u64.to_le_bytes());
        b.splice(table..table, ext);
        b[table - 2] += 1;
    });
    assert!(
        wire_err(&both).contains("carries both a window pool (0x8005) and a pool table (0x8007)"),
        "{}",
        wire_err(&both)
    );
}

#[test]
fn a_must_understand_tag_this_build_does_not_know_is_refused_not_skipped() {
    // As a build that predates the pool table meets 0x8007: renamed to a tag this one lacks.
    let bytes = encode(&pooled()).unwrap();
    let table = find_ext(&bytes, EXT_POOLS, 2 * POOL_RECORD_LEN as u16);
    let unknown = reseal(&bytes, |b| b[table] = 0x7f);
    assert!(
        wire_err(&unknown)
            .contains("the context carries extension 0x807f, which this build does not know"),
        "{}",
        wire_err(&unknown)
    );
}

/// One builder step of a generated layout.
#[derive(Debug, Clone)]
enum Step {
    /// `with_pool(entries, page_size, tokens_per_row)`: entries as a bit mask.
    Pool(u8, u64, u64),
    /// `with_window_pool(page_size)`.
    WindowPool(u64),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let pool = (1u8.., 1u64..4, 1u64..4).prop_map(|(mask, rows, per_row)| {
        let per_row = [1, 2, 4][per_row as usize - 1];
        Step::Pool(mask, rows * per_row, per_row)
    });
    let window = (1u64..9).prop_map(Step::WindowPool);
    prop::collection::vec(prop_oneof![3 => pool, 1 => window], 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_layout_with_further_pools_round_trips(
        n in 3usize..8,
        windows in prop::collection::vec(prop::option::of(1u64..16), 8),
        state in any::<bool>(),
        steps in steps(),
    ) {
        let mut layout = base(n, 16);
        if state {
            layout = layout
                .with_state("mamba", vec![1 << 40], vec![4 * 96], vec![96], vec![n as i64])
                .unwrap();
        }
        let m = layout.n_entries();
        let windows: Vec<Option<u64>> =
            (0..m).map(|i| windows[i].filter(|_| i < n)).collect();
        layout = layout.with_windows(windows).unwrap();
        let mut further = 0;
        for step in steps {
            let next = match step {
                Step::Pool(mask, page_size, per_row) => {
                    // The masked entries still in the request's pages (one entry per pool
                    // when the mask leaves none), so that later pools find members.
                    let free: Vec<usize> =
                        (0..n).filter(|&i| layout.entry(i).pool() == Some(PoolId::PAGES)).collect();
                    let mut entries: Vec<usize> =
                        free.iter().copied().filter(|i| mask >> (i % 8) & 1 == 1).collect();
                    if entries.len() == free.len() && free.len() > 1 {
                        entries.pop();
                    }
                    layout.clone().with_pool(&entries, page_size, per_row)
                }
                Step::WindowPool(page_size) => layout.clone().with_window_pool(page_size),
            };
            if let Ok(next) = next {
                layout = next;
                further = layout.pools().len() - 1;
            }
        }
        prop_assume!(further >= 1 && layout.has_further_pools());
        let bytes = encode(&layout).unwrap();
        let back = decode(&bytes).unwrap();
        prop_assert_eq!(&back, &layout);
        prop_assert_eq!(encode(&back).unwrap(), bytes);
    }
}
