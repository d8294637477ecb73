//! Sliding-window templates whose window entries keep a pool of their own, of another page
//! size ([`Layout::with_windows_in_pool`]), planned through [`Template::plan`] with a
//! [`Request`] that carries each pooled side's window pages.
//!
//! The reference is written here from the layout definition alone, byte by byte: token `t` of
//! a full entry lies in the request's page `pages[t / P]` at slot `t mod P`; token `t` of a
//! window entry in a pool of `Q`-token pages lies in window page `window_pages[t / Q]` at slot
//! `t mod Q` (in the request's pages, like a full entry, on a side without a pool). A request of
//! `n` tokens skipping `K` moves tokens `K..n` of the full entries and only the window's live
//! tokens `max(K, n − W)..n` of the window entries. Same-pool windows are checked against the
//! shared reference in `tokens.rs`.

use std::collections::BTreeMap;

use kvplan_core::{Layout, LayoutContext, Request, Template, TemplateOptions};

/// Bytes of one token of one entry.
const TOKEN: u64 = 8;
/// Pages each buffer holds, in its own page size.
const PAGES: u64 = 32;
/// Window entries' buffers start this far from the full entry's.
const WINDOW_AT: u64 = 0x10_0000;

/// One side: layer 0 full attention at `page_size` tokens per page, layer 1 a sliding window of
/// `window` tokens, in a pool of `pool` tokens per page when given.
#[derive(Clone, Copy, Debug)]
struct Side {
    base: u64,
    page_size: u64,
    pool: Option<u64>,
}

impl Side {
    fn window_page_size(self) -> u64 {
        self.pool.unwrap_or(self.page_size)
    }

    fn layout(self, window: u64) -> Layout {
        let (full, win) = (self.page_size * TOKEN, self.window_page_size() * TOKEN);
        Layout::mla(
            vec![self.base, self.base + WINDOW_AT],
            vec![PAGES * full, PAGES * win],
            vec![full, win],
            Some(vec![0, 1]),
            LayoutContext {
                page_size: self.page_size,
                ..LayoutContext::default()
            },
        )
        .unwrap()
        .with_windows_in_pool(vec![None, Some(window)], self.pool)
        .unwrap()
    }

    /// Address of token `t`'s first byte in entry 0 (full) or 1 (window).
    fn token_addr(self, entry: u64, t: u64, pages: &[i64], window_pages: &[i64]) -> u64 {
        let (size, list) = match (entry, self.pool) {
            (1, Some(q)) => (q, window_pages),
            _ => (self.page_size, pages),
        };
        let page = u64::try_from(list[(t / size) as usize]).expect("a read page is not -1");
        self.base + entry * WINDOW_AT + page * size * TOKEN + (t % size) * TOKEN
    }
}

/// `dst byte → src byte` of what the definition copies.
fn reference(
    (src, dst): (Side, Side),
    (src_pages, dst_pages): (&[i64], &[i64]),
    (src_win, dst_win): (&[i64], &[i64]),
    window: u64,
    n: u64,
    skip: u64,
) -> BTreeMap<u64, u64> {
    let mut map = BTreeMap::new();
    for (entry, first) in [(0, skip), (1, skip.max(n.saturating_sub(window)))] {
        for t in first..n {
            let s = src.token_addr(entry, t, src_pages, src_win);
            let d = dst.token_addr(entry, t, dst_pages, dst_win);
            for b in 0..TOKEN {
                map.insert(d + b, s + b);
            }
        }
    }
    map
}

/// `dst byte → src byte` of a plan's blocks, each destination byte written once.
fn planned(src_addrs: &[u64], dst_addrs: &[u64], lengths: &[u64]) -> BTreeMap<u64, u64> {
    let mut map = BTreeMap::new();
    for ((&s, &d), &len) in src_addrs.iter().zip(dst_addrs).zip(lengths) {
        for b in 0..len {
            assert!(
                map.insert(d + b, s + b).is_none(),
                "byte {:#x} written twice",
                d + b
            );
        }
    }
    map
}

/// Distinct pages of `0..PAGES` for `tokens` tokens of `size`-token pages, scattered by `step`
/// (odd, so coprime to `PAGES`); with `unread_before`, the pages before the one holding that
/// token are `-1` (never read).
fn page_list(tokens: u64, size: u64, step: u64, unread_before: Option<u64>) -> Vec<i64> {
    let first_read = unread_before.map_or(0, |t| t / size);
    (0..tokens.div_ceil(size))
        .map(|i| {
            if i < first_read {
                -1
            } else {
                ((i * step + 3) % PAGES) as i64
            }
        })
        .collect()
}

#[test]
fn a_pooled_window_moves_only_its_live_tokens_between_page_sizes() {
    let pools = [
        (Some(2), Some(3)),
        (Some(3), None),
        (None, Some(1)),
        (Some(5), Some(5)),
    ];
    for (src_pool, dst_pool) in pools {
        for (ps, pd) in [(4, 4), (2, 8), (8, 3)] {
            let src = Side {
                base: 0x100_0000,
                page_size: ps,
                pool: src_pool,
            };
            let dst = Side {
                base: 0x900_0000,
                page_size: pd,
                pool: dst_pool,
            };
            for window in [1, 5, 9] {
                let template = Template::new(
                    &src.layout(window),
                    &dst.layout(window),
                    TemplateOptions::default(),
                )
                .unwrap();
                for n in 0..24u64 {
                    for skip in [0, n / 3, n.saturating_sub(1), n] {
                        let first_live = skip.max(n.saturating_sub(window));
                        let src_pages = page_list(n, ps, 5, None);
                        let dst_pages = page_list(n, pd, 7, None);
                        // A pooled side's window pages before the window are never read.
                        let src_win = page_list(n, src.window_page_size(), 9, Some(first_live));
                        let dst_win = page_list(n, dst.window_page_size(), 11, Some(first_live));
                        let request = Request::tokens(&src_pages[..], &dst_pages[..], n)
                            .skipping(skip)
                            .with_window_pages(
                                src_pool.is_some().then_some(&src_win[..]),
                                dst_pool.is_some().then_some(&dst_win[..]),
                            );
                        let case = format!(
                            "pools {src_pool:?}->{dst_pool:?}, pages {ps}->{pd}, window {window}, \
                             n {n}, skip {skip}"
                        );
                        let plan = template
                            .plan(&request)
                            .unwrap_or_else(|e| panic!("{case}: {e}"));
                        let got = planned(&plan.src_addrs, &plan.dst_addrs, &plan.lengths);
                        let want = reference(
                            (src, dst),
                            (&src_pages, &dst_pages),
                            (&src_win, &dst_win),
                            window,
                            n,
                            skip,
                        );
                        assert_eq!(got, want, "{case}");
                        let moved = (n - skip) + (n - first_live);
                        assert_eq!(plan.total_bytes, moved * TOKEN, "{case}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_window_entry_reads_nothing_outside_its_pool_pages() {
    // The window layer's blocks lie inside the window pool's pages the request names (never
    // in the pages before the window, never in the full entry's pages).
    let src = Side {
        base: 0x100_0000,
        page_size: 4,
        pool: Some(2),
    };
    let dst = Side {
        base: 0x900_0000,
        page_size: 4,
        pool: Some(3),
    };
    let window = 5;
    let template = Template::new(
        &src.layout(window),
        &dst.layout(window),
        TemplateOptions::default(),
    )
    .unwrap();
    let n = 17;
    let src_pages = page_list(n, 4, 5, None);
    let dst_pages = page_list(n, 4, 7, None);
    let src_win = page_list(n, 2, 9, Some(n - window));
    let dst_win = page_list(n, 3, 11, Some(n - window));
    let request = Request::tokens(&src_pages[..], &dst_pages[..], n)
        .with_window_pages(Some(&src_win[..]), Some(&dst_win[..]));
    let plan = template.plan(&request).unwrap();
    let window_src: Vec<(u64, u64)> = src_win
        .iter()
        .filter(|&&p| p >= 0)
        .map(|&p| src.base + WINDOW_AT + p as u64 * 2 * TOKEN)
        .map(|start| (start, start + 2 * TOKEN))
        .collect();
    let mut window_bytes = 0;
    for (&s, &len) in plan.src_addrs.iter().zip(&plan.lengths) {
        if s >= src.base + WINDOW_AT {
            assert!(
                window_src.iter().any(|&(lo, hi)| lo <= s && s + len <= hi),
                "window block at {s:#x} outside the live window pages"
            );
            window_bytes += len;
        }
    }
    assert_eq!(window_bytes, window * TOKEN);
}
