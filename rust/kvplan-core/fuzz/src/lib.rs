//! Shared input recipes and property checks for kvplan-core's fuzz targets.
//!
//! Every target turns fuzzer bytes into a structured input (via `arbitrary`), calls the core,
//! and then checks, on every accepted input, the properties an RDMA engine relies on:
//! every block inside its entry's buffer, no u64 overflow (all arithmetic redone in u128),
//! byte conservation (sum of lengths = pages × bytes per page), no destination item written
//! twice when the overlap check is on, and agreement with a naive reference. Rejected inputs
//! must be rejected for a reason the reference also sees. Any panic is a crash.

use std::collections::HashSet;

use arbitrary::{Arbitrary, Unstructured};
use kvplan_core::{
    Columns, Indexing, FlatBuffer, Layout, LayoutContext, LayoutParts, LegacyKind, PlanError,
    Pairing, Template, TemplateOptions, check_pairs, pair_entries, model::runs::group_contiguous,
};

// ------------------------------------------------------------------------------------ runs

/// Naive maximal runs (both sides step by exactly +1), in i128 so nothing overflows.
pub fn reference_runs(src: &[i64], dst: &[i64]) -> Vec<(i64, i64, u64)> {
    let mut runs: Vec<(i64, i64, u64)> = Vec::new();
    for i in 0..src.len() {
        let continues = i > 0
            && i128::from(src[i]) - i128::from(src[i - 1]) == 1
            && i128::from(dst[i]) - i128::from(dst[i - 1]) == 1;
        if continues {
            runs.last_mut().unwrap().2 += 1;
        } else {
            runs.push((src[i], dst[i], 1));
        }
    }
    runs
}

/// An index array in one of the two dtypes engines use.
#[derive(Debug, Clone)]
pub enum Indices {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl Indices {
    pub fn widened(&self) -> Vec<i64> {
        match self {
            Indices::I32(v) => v.iter().map(|&x| i64::from(x)).collect(),
            Indices::I64(v) => v.clone(),
        }
    }
}

/// Checks `group_contiguous` on one input (any dtype mix).
pub fn check_runs(src: &Indices, dst: &Indices) {
    let result = match (src, dst) {
        (Indices::I32(s), Indices::I32(d)) => group_contiguous(s, d),
        (Indices::I32(s), Indices::I64(d)) => group_contiguous(s, d),
        (Indices::I64(s), Indices::I32(d)) => group_contiguous(s, d),
        (Indices::I64(s), Indices::I64(d)) => group_contiguous(s, d),
    };
    let (s, d) = (src.widened(), dst.widened());
    match result {
        Ok((starts_s, starts_d, lengths)) => {
            assert_eq!(s.len(), d.len(), "unequal lengths accepted");
            assert!(s.iter().chain(&d).all(|&x| x >= 0), "negative accepted");
            let expected = reference_runs(&s, &d);
            let got: Vec<(i64, i64, u64)> = starts_s
                .iter()
                .zip(&starts_d)
                .zip(&lengths)
                .map(|((&a, &b), &n)| (a as i64, b as i64, n))
                .collect();
            assert_eq!(got, expected, "runs differ from reference");
            assert_eq!(lengths.iter().sum::<u64>(), s.len() as u64, "pages not conserved");
        }
        Err(PlanError::LengthMismatch { src: a, dst: b }) => {
            assert_ne!(a, b);
            assert_eq!((a, b), (s.len(), d.len()));
        }
        Err(PlanError::NegativeIndex {
            side,
            index,
            position,
        }) => {
            assert_eq!(s.len(), d.len());
            let values = if side == kvplan_core::Side::Src { &s } else { &d };
            assert!(index < 0 && values[position] == index, "wrong negative reported");
        }
        Err(other) => panic!("unexpected error from group_contiguous: {other}"),
    }
}

// ------------------------------------------------------------------------------ pairing

/// Checks the invariants of a successful pairing: one pair per source entry in order,
/// destination entries in range and distinct, ids (and roles when both publish) equal.
pub fn check_pairing_result(
    pairs: &[[usize; 2]],
    n_src: usize,
    n_dst: usize,
    src_ids: Option<&[i64]>,
    dst_ids: Option<&[i64]>,
    roles: Option<(&[String], &[String])>,
) {
    assert_eq!(pairs.len(), n_src, "not every source entry paired");
    let mut seen = HashSet::new();
    for (i, &[s, d]) in pairs.iter().enumerate() {
        assert_eq!(s, i, "pairs out of source order");
        assert!(d < n_dst, "dst entry {d} out of range 0..{n_dst}");
        assert!(seen.insert(d), "dst entry {d} paired twice");
        if let (Some(a), Some(b)) = (src_ids, dst_ids) {
            assert_eq!(a[s], b[d], "paired entries have different layer ids");
        }
        if let Some((a, b)) = roles {
            assert_eq!(a[s], b[d], "paired entries have different roles");
        }
    }
}

const ROLE_ALPHABET: [&str; 6] = ["kv", "k", "v", "g0", "g1", "draft"];

#[derive(Debug, Arbitrary)]
pub struct PairingInput {
    pub src_ids: Option<Vec<i8>>,
    pub dst_ids: Option<Vec<i8>>,
    pub src_roles: Option<Vec<u8>>,
    pub dst_roles: Option<Vec<u8>>,
    pub n_src_delta: i8,
    pub n_dst_delta: i8,
    pub fallback: bool,
    pub legacy_mha: bool,
    pub legacy_n_src: u64,
    pub legacy_n_dst: u64,
    pub legacy_start: u64,
    pub legacy_draft: u64,
    pub legacy_decode_layers: Option<u64>,
    pub legacy_small: bool,
}

fn roles_of(codes: &[u8]) -> Vec<String> {
    codes
        .iter()
        .map(|&c| ROLE_ALPHABET[usize::from(c) % ROLE_ALPHABET.len()].to_string())
        .collect()
}

fn meta<'a>(
    ids: &'a Option<Vec<i64>>,
    roles: &'a Option<Vec<String>>,
    n: usize,
) -> kvplan_core::EntryMetadata<'a> {
    kvplan_core::EntryMetadata {
        layer_ids: ids.as_deref(),
        roles: roles.as_deref(),
        n_entries: n,
    }
}

pub fn check_pairing(input: &PairingInput) {
    let src_ids: Option<Vec<i64>> = input
        .src_ids
        .as_ref()
        .map(|v| v.iter().map(|&x| i64::from(x % 8)).collect());
    let dst_ids: Option<Vec<i64>> = input
        .dst_ids
        .as_ref()
        .map(|v| v.iter().map(|&x| i64::from(x % 8)).collect());
    let base = |ids: &Option<Vec<i64>>| ids.as_ref().map_or(4, Vec::len);
    let n_src = (base(&src_ids) as i64 + i64::from(input.n_src_delta % 3)).max(0) as usize;
    let n_dst = (base(&dst_ids) as i64 + i64::from(input.n_dst_delta % 3)).max(0) as usize;
    let src_roles = input.src_roles.as_deref().map(roles_of);
    let dst_roles = input.dst_roles.as_deref().map(roles_of);
    let result = pair_entries(
        meta(&src_ids, &src_roles, n_src),
        meta(&dst_ids, &dst_roles, n_dst),
        input.fallback,
    );
    let each = kvplan_core::pair_each(
        meta(&src_ids, &src_roles, n_src),
        meta(&dst_ids, &dst_roles, n_dst),
        input.fallback,
    );
    let published = |ids: &Option<Vec<i64>>| ids.as_ref().filter(|v| !v.is_empty()).cloned();
    match &result {
        Ok(pairs) => {
            let (sp, dp) = (published(&src_ids), published(&dst_ids));
            let identity = sp.is_some() && dp.is_some();
            let roles = match (&src_roles, &dst_roles) {
                (Some(a), Some(b)) if identity => Some((a.as_slice(), b.as_slice())),
                _ => None,
            };
            let (si, di) = if identity {
                (sp.as_deref(), dp.as_deref())
            } else {
                (None, None)
            };
            check_pairing_result(pairs, n_src, n_dst, si, di, roles);
            // pair_each agrees entry by entry.
            let each = each.expect("pair_each failed where pair_entries succeeded");
            let partners: Vec<usize> = each.into_iter().map(Result::unwrap).collect();
            assert_eq!(partners, pairs.iter().map(|p| p[1]).collect::<Vec<_>>());
        }
        Err(err) => {
            // pair_entries fails with the list-level error or the first entry's problem.
            match each {
                Err(e) => assert_eq!(&e, err),
                Ok(list) => {
                    let first = list.into_iter().find_map(Result::err);
                    assert_eq!(first.as_ref(), Some(err), "pair_each disagrees");
                }
            }
        }
    }

    // Legacy positional PP slicing, over the full usize range (user-controlled from Python).
    let clamp = |x: u64| {
        if input.legacy_small {
            (x % 64) as usize
        } else {
            x as usize
        }
    };
    let (n_src, n_dst) = (clamp(input.legacy_n_src), clamp(input.legacy_n_dst));
    let (start, draft) = (clamp(input.legacy_start), clamp(input.legacy_draft));
    let decode_layers = input.legacy_decode_layers.map(clamp);
    let kind = if input.legacy_mha {
        LegacyKind::Mha
    } else {
        LegacyKind::Mla
    };
    // Huge counts only make sense when the result would be small; skip what cannot be allocated.
    if n_src > 1 << 16 {
        return;
    }
    if let Ok(pairs) = kvplan_core::legacy_pp_pairs(kind, n_src, n_dst, start, draft, decode_layers) {
        check_pairing_result(&pairs, n_src, n_dst, None, None, None);
    }
}

// ------------------------------------------------------------------------------ layouts

/// One buffer: where it lives, how long it is, bytes per item.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub struct Buf {
    pub ptr_mode: u8,
    pub ptr: u64,
    pub cap_mode: u8,
    pub cap: u64,
    pub item_mode: u8,
    pub item: u64,
    pub slack: u8,
}

impl Buf {
    /// `(data_ptr, data_len, item_len)`: mostly small, realistic values with some extremes.
    pub fn resolve(&self) -> (u64, u64, u64) {
        let item = match self.item_mode % 8 {
            0 => 0,
            1 => 1,
            2 | 3 => 64,
            4 => 8 << (self.item % 8),
            5 => self.item % 4096,
            6 => self.item,
            _ => 1152,
        };
        let cap = match self.cap_mode % 6 {
            0 => 0,
            1..=3 => self.cap % 48,
            4 => self.cap % 1024,
            _ => self.cap,
        };
        let len = item
            .saturating_mul(cap)
            .saturating_add(u64::from(self.slack) % (item.max(1)));
        let ptr = match self.ptr_mode % 6 {
            0 => self.ptr % (1 << 20) * 64,
            1 | 2 => (self.ptr % 64 + 1) << 32,
            // Right at the top of the address space (base + len == u64::MAX or just below).
            3 => u64::MAX - len - (self.ptr % 4).min(u64::MAX - len),
            4 => self.ptr,
            _ => 0,
        };
        (ptr, len, item)
    }
}

#[derive(Debug, Clone, Arbitrary)]
pub struct RawEntry {
    pub buf: Buf,
    pub id: Option<i8>,
    pub role: Option<u8>,
    pub state: bool,
}

#[derive(Debug, Clone, Arbitrary)]
pub enum Recipe {
    /// `Layout::new` from raw lists (ids / roles all-or-none per layout, or per entry when mixed).
    Raw {
        entries: Vec<RawEntry>,
        ids: u8,
        roles: u8,
    },
    Mla {
        bufs: Vec<Buf>,
        ids: Option<Vec<u8>>,
    },
    Mha {
        k: Vec<Buf>,
        v: Vec<Buf>,
        ids: Option<Vec<u8>>,
    },
    Hybrid {
        ids: Vec<i8>,
        bufs: Vec<Buf>,
        mla: bool,
    },
    Npu {
        ids: Vec<u8>,
        bufs: Vec<Buf>,
        roles: Option<Vec<u8>>,
    },
}

#[derive(Debug, Clone, Arbitrary)]
pub struct LayoutRecipe {
    pub recipe: Recipe,
    pub draft: Option<(Vec<Buf>, Vec<u8>, i8, bool)>,
    pub state: Option<(u8, Vec<Buf>, Vec<u8>)>,
    pub num_model_layers: Option<u8>,
}

fn cols(bufs: &[Buf]) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for b in bufs.iter().take(24) {
        let (p, l, i) = b.resolve();
        out.0.push(p);
        out.1.push(l);
        out.2.push(i);
    }
    out
}

fn small_ids(ids: &[u8], n: usize) -> Vec<i64> {
    (0..n)
        .map(|k| ids.get(k).map_or(k as i64, |&x| i64::from(x % 12)))
        .collect()
}

impl LayoutRecipe {
    /// Builds the layout (errors are fine: they must just not be panics).
    pub fn build(&self) -> kvplan_core::Result<Layout> {
        let ctx = LayoutContext {
            num_model_layers: self.num_model_layers.map(u64::from),
            ..LayoutContext::default()
        };
        let mut layout = match &self.recipe {
            Recipe::Raw {
                entries,
                ids,
                roles,
            } => {
                let entries = &entries[..entries.len().min(24)];
                let mut parts = LayoutParts::default();
                for e in entries {
                    let (p, l, i) = e.buf.resolve();
                    parts.data_ptrs.push(p);
                    parts.data_lens.push(l);
                    parts.item_lens.push(i);
                    parts.kinds.push(if e.state {
                        Indexing::State
                    } else {
                        Indexing::Page
                    });
                    // 0: none, 1: all, 2+: whatever each entry says (usually invalid).
                    parts.layer_ids.push(match ids % 3 {
                        0 => None,
                        1 => Some(i64::from(e.id.unwrap_or(0) % 12)),
                        _ => e.id.map(i64::from),
                    });
                    parts.roles.push(match roles % 3 {
                        0 => String::new(),
                        1 => ROLE_ALPHABET[usize::from(e.role.unwrap_or(0)) % 6].into(),
                        _ => e
                            .role
                            .map_or(String::new(), |r| ROLE_ALPHABET[usize::from(r) % 6].into()),
                    });
                }
                Layout::new(parts, ctx.clone())?
            }
            Recipe::Mla { bufs, ids } => {
                let (p, l, i) = cols(bufs);
                let ids = ids.as_ref().map(|v| small_ids(v, p.len()));
                Layout::mla(p, l, i, ids, ctx.clone())?
            }
            Recipe::Mha { k, v, ids } => {
                let (kp, kl, ki) = cols(k);
                let (vp, vl, vi) = cols(v);
                let ids = ids.as_ref().map(|x| small_ids(x, kp.len()));
                Layout::mha(kp, vp, kl, vl, ki, vi, ids, ctx.clone())?
            }
            Recipe::Hybrid { ids, bufs, mla } => {
                let ids: Vec<i64> = ids.iter().take(12).map(|&x| i64::from(x)).collect();
                let (p, l, i) = cols(bufs);
                Layout::hybrid_linear(ids, p, l, i, *mla, ctx.clone())?
            }
            Recipe::Npu { ids, bufs, roles } => {
                let ids: Vec<i64> = ids.iter().take(8).map(|&x| i64::from(x % 12)).collect();
                let (p, l, i) = cols(bufs);
                let roles = roles.as_deref().map(roles_of);
                Layout::npu_groups(ids, p, l, i, roles, ctx.clone())?
            }
        };
        if let Some((bufs, raw_ids, hidden, with_roles)) = &self.draft {
            let (p, l, i) = cols(bufs);
            let ids = small_ids(raw_ids, p.len());
            let roles = with_roles.then(|| vec!["kv".to_string(); p.len()]);
            layout = layout.with_draft(p, l, i, &ids, i64::from(*hidden), roles)?;
        }
        if let Some((name, bufs, raw_ids)) = &self.state {
            let (p, l, i) = cols(bufs);
            let ids = small_ids(raw_ids, p.len());
            let name = ["mamba_conv", "mamba_temporal", ""][usize::from(*name) % 3];
            layout = layout.with_state(name, p, l, i, ids)?;
        }
        Ok(layout)
    }
}

/// Every accepted layout satisfies its own invariants.
pub fn check_layout(layout: &Layout) {
    let parts = layout.parts();
    let n = layout.n_entries();
    assert_eq!(parts.data_lens.len(), n);
    assert_eq!(parts.item_lens.len(), n);
    assert_eq!(parts.layer_ids.len(), n);
    assert_eq!(parts.roles.len(), n);
    assert_eq!(parts.kinds.len(), n);
    for i in 0..n {
        assert!(
            u128::from(parts.data_ptrs[i]) + u128::from(parts.data_lens[i]) <= u128::from(u64::MAX),
            "accepted layout with a buffer past u64"
        );
        let cap = layout.capacity(i);
        assert!(u128::from(cap) * u128::from(parts.item_lens[i]) <= u128::from(parts.data_lens[i]));
    }
}

// ------------------------------------------------------------------------------ planning

#[derive(Debug, Clone, Arbitrary)]
pub struct IndexRecipe {
    pub wide: bool,
    pub mode: u8,
    pub start: u16,
    pub values: Vec<u16>,
    pub extreme: Option<(u8, u8)>,
}

impl IndexRecipe {
    /// Indices mostly within `0..limit + 2` (so some are just out of range), sometimes in runs.
    pub fn make(&self, limit: u64, len: usize) -> Indices {
        let span = limit.saturating_add(2).min(1 << 20);
        let mut v: Vec<i64> = match self.mode % 4 {
            // one contiguous run
            0 => (0..len as i64).map(|k| i64::from(self.start) + k).collect(),
            // random within range
            1 | 2 => (0..len)
                .map(|k| {
                    let x = self.values.get(k % self.values.len().max(1)).copied().unwrap_or(0);
                    (u64::from(x) % span) as i64
                })
                .collect(),
            // runs of random lengths with random jumps
            _ => {
                let mut out = Vec::with_capacity(len);
                let mut cur = i64::from(self.start) % span as i64;
                for k in 0..len {
                    let x = self.values.get(k % self.values.len().max(1)).copied().unwrap_or(0);
                    if x % 5 == 0 {
                        cur = (u64::from(x) % span) as i64;
                    } else {
                        cur += 1;
                    }
                    out.push(cur);
                }
                out
            }
        };
        if let Some((pos, which)) = self.extreme
            && !v.is_empty()
        {
            let at = usize::from(pos) % v.len();
            v[at] = match which % 8 {
                0 => -1,
                1 => i64::from(i32::MIN),
                2 => i64::from(i32::MAX),
                3 => i64::MIN,
                4 => i64::MAX,
                5 => limit as i64,
                6 => limit.saturating_sub(1) as i64,
                _ => v[at] + 1,
            };
        }
        if self.wide {
            Indices::I64(v)
        } else {
            Indices::I32(v.into_iter().map(|x| x as i32).collect())
        }
    }
}

#[derive(Debug, Clone, Arbitrary)]
pub struct PlanInput {
    pub src: LayoutRecipe,
    pub dst: LayoutRecipe,
    pub fallback: bool,
    pub prefill_start_layer: Option<u8>,
    pub legacy_kind: u8,
    pub check_dst_overlap: bool,
    pub len: u8,
    pub len_delta: i8,
    pub src_idx: IndexRecipe,
    pub dst_idx: IndexRecipe,
    pub out_capacity: Option<u16>,
    pub src_slot: i64,
    pub dst_slot: i64,
    pub small_slots: bool,
    pub state_out: u8,
}

/// What a correct planner must do with a request, computed naively.
fn expected_rejection(
    template: &Template,
    overlap: bool,
    src_layout: &Layout,
    dst_layout: &Layout,
    s: &[i64],
    d: &[i64],
) -> Option<&'static str> {
    if s.len() != d.len() {
        return Some("length");
    }
    if s.iter().chain(d).any(|&x| x < 0) {
        return Some("negative");
    }
    for p in template.emitting_pairs() {
        let (sc, dc) = (src_layout.capacity(p.src_entry), dst_layout.capacity(p.dst_entry));
        if s.iter().any(|&x| x as u64 >= sc) || d.iter().any(|&x| x as u64 >= dc) {
            return Some("bounds");
        }
    }
    if overlap && !s.is_empty() {
        let mut seen = HashSet::new();
        if !d.iter().all(|x| seen.insert(*x)) {
            return Some("duplicate");
        }
    }
    None
}

fn rejection_kind(err: &PlanError) -> &'static str {
    match err {
        PlanError::LengthMismatch { .. } => "length",
        PlanError::NegativeIndex { .. } => "negative",
        PlanError::IndexOutOfRange { .. } => "bounds",
        PlanError::DuplicateDestination { .. } => "duplicate",
        PlanError::Overflow { .. } => "overflow",
        PlanError::OutputTooSmall { .. } => "output",
        _ => "other",
    }
}

/// Checks one plan against the naive reference and the safety properties.
#[allow(clippy::too_many_arguments)]
fn check_plan_blocks(
    template: &Template,
    overlap: bool,
    src_layout: &Layout,
    dst_layout: &Layout,
    s: &[i64],
    d: &[i64],
    src_addrs: &[u64],
    dst_addrs: &[u64],
    lengths: &[u64],
    n_runs: usize,
    total_bytes: u64,
) {
    let runs = reference_runs(s, d);
    assert_eq!(n_runs, runs.len(), "run count");
    let (sp, dp) = (src_layout.parts(), dst_layout.parts());
    let mut expected = Vec::new();
    let mut written: HashSet<(usize, u64)> = HashSet::new();
    for p in template.emitting_pairs() {
        let l = u128::from(p.item_len);
        assert_eq!(sp.item_lens[p.src_entry], p.item_len);
        assert_eq!(dp.item_lens[p.dst_entry], p.item_len);
        for &(a, b, n) in &runs {
            let sa = u128::from(sp.data_ptrs[p.src_entry]) + a as u128 * l;
            let da = u128::from(dp.data_ptrs[p.dst_entry]) + b as u128 * l;
            let len = u128::from(n) * l;
            // Inside the entry's registered buffer, on both sides (and so inside u64).
            assert!(
                sa + len <= u128::from(sp.data_ptrs[p.src_entry]) + u128::from(sp.data_lens[p.src_entry]),
                "src block outside its buffer"
            );
            assert!(
                da + len <= u128::from(dp.data_ptrs[p.dst_entry]) + u128::from(dp.data_lens[p.dst_entry]),
                "dst block outside its buffer"
            );
            if overlap {
                for k in 0..n {
                    assert!(
                        written.insert((p.dst_entry, b as u64 + k)),
                        "dst item written twice with check_dst_overlap on"
                    );
                }
            }
            expected.push((sa as u64, da as u64, len as u64));
        }
    }
    let got: Vec<(u64, u64, u64)> = src_addrs
        .iter()
        .zip(dst_addrs)
        .zip(lengths)
        .map(|((&a, &b), &c)| (a, b, c))
        .collect();
    assert_eq!(got, expected, "blocks differ from the reference");
    let sum: u128 = lengths.iter().map(|&x| u128::from(x)).sum();
    let conserved = s.len() as u128 * u128::from(template.bytes_per_page());
    assert_eq!(sum, conserved, "byte conservation");
    assert_eq!(u128::from(total_bytes), conserved, "total_bytes");
}

fn plan_with<S: kvplan_core::PageIndex, D: kvplan_core::PageIndex>(
    t: &Template,
    s: &[S],
    d: &[D],
    out_capacity: Option<usize>,
) -> kvplan_core::Result<(Vec<u64>, Vec<u64>, Vec<u64>, usize, u64)> {
    match out_capacity {
        None => t
            .plan(s, d, None)
            .map(|p| (p.src_addrs, p.dst_addrs, p.lengths, p.n_runs, p.total_bytes)),
        Some(cap) => {
            // A caller-provided buffer of fixed size, pre-filled with garbage.
            let mut buf = FlatBuffer {
                data: vec![0xDEAD_BEEF; cap * 3],
                capacity: cap,
            };
            let (_, summary) = t.plan_into(s, d, None, |_| Ok(Columns::from_flat(&mut buf.data, cap)))?;
            let n = summary.n_blocks;
            Ok((
                buf.data[..n].to_vec(),
                buf.data[cap..cap + n].to_vec(),
                buf.data[2 * cap..2 * cap + n].to_vec(),
                summary.n_runs,
                summary.total_bytes,
            ))
        }
    }
}

pub fn check_plan(input: &PlanInput) {
    let (Ok(src), Ok(dst)) = (input.src.build(), input.dst.build()) else {
        return;
    };
    check_layout(&src);
    check_layout(&dst);
    let options = TemplateOptions {
        pairing: Pairing::by_layer_id(
            input.fallback,
            input.prefill_start_layer.map(|x| usize::from(x % 16)),
            match input.legacy_kind % 3 {
                0 => None,
                1 => Some(LegacyKind::Mla),
                _ => Some(LegacyKind::Mha),
            },
        ),
        check_dst_overlap: input.check_dst_overlap,
        ..TemplateOptions::default()
    };
    let checks = check_pairs(&src, &dst, options);
    let first_problem = checks.iter().find_map(|c| c.problem.clone());
    let template = match Template::new(&src, &dst, options) {
        Ok(t) => {
            assert!(first_problem.is_none(), "check_pairs reports a problem the template accepted");
            t
        }
        Err(err) => {
            if let Some(problem) = first_problem {
                assert_eq!(err, problem, "Template::new and check_pairs disagree");
            } else {
                assert!(matches!(err, PlanError::Overflow { .. }), "unexplained template error {err}");
            }
            return;
        }
    };
    // Pairs: kinds match, item lengths match, destination entries distinct within a kind.
    for (pairs, kind) in [
        (template.page_pairs(), Indexing::Page),
        (template.state_pairs(), Indexing::State),
    ] {
        let mut seen = HashSet::new();
        for p in pairs {
            assert!(p.src_entry < src.n_entries() && p.dst_entry < dst.n_entries());
            assert_eq!(src.entry(p.src_entry).indexing(), kind);
            assert_eq!(dst.entry(p.dst_entry).indexing(), kind);
            assert_eq!(src.entry(p.src_entry).item_len, dst.entry(p.dst_entry).item_len);
            assert!(seen.insert(p.dst_entry), "dst entry {} paired twice", p.dst_entry);
            if let (Some(a), Some(b)) = (src.entry(p.src_entry).layer, dst.entry(p.dst_entry).layer) {
                assert_eq!(a, b, "paired by identity but ids differ");
            }
        }
        assert_eq!(
            pairs.len(),
            src.entries_of_kind(kind).len(),
            "a source entry of kind {kind:?} is unpaired"
        );
    }

    // Page plans.
    let emitting_limit = |side_src: bool| {
        template
            .emitting_pairs()
            .iter()
            .map(|p| if side_src { p.src_capacity } else { p.dst_capacity })
            .min()
            .unwrap_or(64)
    };
    let len = usize::from(input.len);
    let dst_len = (len as i64 + i64::from(input.len_delta % 2)).max(0) as usize;
    let src_idx = input.src_idx.make(emitting_limit(true), len);
    let dst_idx = input.dst_idx.make(emitting_limit(false), dst_len);
    let (s, d) = (src_idx.widened(), dst_idx.widened());
    let out_capacity = input.out_capacity.map(|c| usize::from(c) % 2048);
    let result = match (&src_idx, &dst_idx) {
        (Indices::I32(a), Indices::I32(b)) => plan_with(&template, a, b, out_capacity),
        (Indices::I32(a), Indices::I64(b)) => plan_with(&template, a, b, out_capacity),
        (Indices::I64(a), Indices::I32(b)) => plan_with(&template, a, b, out_capacity),
        (Indices::I64(a), Indices::I64(b)) => plan_with(&template, a, b, out_capacity),
    };
    let expected = expected_rejection(&template, input.check_dst_overlap, &src, &dst, &s, &d);
    match result {
        Ok((sa, da, ln, n_runs, total)) => {
            assert_eq!(expected, None, "accepted a request the reference rejects");
            check_plan_blocks(&template, input.check_dst_overlap, &src, &dst, &s, &d, &sa, &da, &ln, n_runs, total);
        }
        Err(err) => {
            let kind = rejection_kind(&err);
            match (kind, expected) {
                (k, Some(e)) if k == e => {}
                ("output", None) => {
                    let need = reference_runs(&s, &d).len() * template.emitting_pairs().len();
                    assert!(out_capacity.is_some_and(|c| c < need), "spurious OutputTooSmall");
                }
                ("overflow", None) => {}
                _ => panic!("rejected for {kind} ({err}) but the reference says {expected:?}"),
            }
        }
    }

    // State plans.
    let slot = |x: i64| if input.small_slots { x % 64 } else { x };
    let (ss, ds) = (slot(input.src_slot), slot(input.dst_slot));
    let n_state = template.state_pairs().len();
    let cap = if input.state_out % 8 == 0 { n_state.saturating_sub(1) } else { n_state };
    let mut buf = FlatBuffer {
        data: vec![0xDEAD_BEEF; cap * 3],
        capacity: cap,
    };
    let result = template
        .plan_state_into(ss, ds, Columns::from_flat(&mut buf.data, cap))
        .map(|summary| summary.n_blocks);
    let in_bounds = ss >= 0
        && ds >= 0
        && template
            .state_pairs()
            .iter()
            .all(|p| (ss as u64) < p.src_capacity && (ds as u64) < p.dst_capacity);
    match result {
        Ok(n) => {
            assert_eq!(n, n_state);
            assert!(in_bounds, "state slot out of bounds accepted");
            for (k, p) in template.state_pairs().iter().enumerate() {
                let l = u128::from(p.item_len);
                let sa = u128::from(p.src_base) + ss as u128 * l;
                let da = u128::from(p.dst_base) + ds as u128 * l;
                assert_eq!(buf.data[k], sa as u64);
                assert_eq!(buf.data[cap + k], da as u64);
                assert_eq!(buf.data[2 * cap + k], p.item_len);
                assert!(sa + l <= u128::from(p.src_base) + u128::from(src.entry(p.src_entry).buffer.1));
                assert!(da + l <= u128::from(p.dst_base) + u128::from(dst.entry(p.dst_entry).buffer.1));
            }
        }
        Err(PlanError::OutputTooSmall { .. }) => assert!(cap < n_state),
        Err(err) => {
            assert!(!in_bounds || cap < n_state, "state slot rejected but in bounds: {err}");
        }
    }
}

// ------------------------------------------------------------------------------ wire

#[derive(Debug, Arbitrary)]
pub enum WireInput {
    /// Raw bytes straight into the decoder.
    Bytes(Vec<u8>),
    /// A valid encoding, then mutated (optionally with the checksum fixed up so the mutation
    /// reaches the parser behind the CRC).
    Mutated {
        layout: LayoutRecipe,
        device: u8,
        edits: Vec<(u16, u8)>,
        truncate: Option<u16>,
        fix_crc: bool,
    },
}

/// Decodes, and when accepted checks that the decoded layout re-encodes to an equal layout.
fn decode_checked(bytes: &[u8]) {
    if let Ok(layout) = kvplan_core::exchange::wire::decode(bytes) {
        check_layout(&layout);
        let again = kvplan_core::exchange::wire::encode(&layout).expect("accepted layout must re-encode");
        let back = kvplan_core::exchange::wire::decode(&again).expect("re-encoded layout must decode");
        assert_eq!(back, layout, "decode(encode(x)) != x");
    }
}

pub fn check_wire(input: &WireInput) {
    match input {
        WireInput::Bytes(bytes) => decode_checked(bytes),
        WireInput::Mutated {
            layout,
            device,
            edits,
            truncate,
            fix_crc,
        } => {
            let Ok(layout) = layout.build() else {
                return;
            };
            // Vary the context as well (the recipe only sets num_model_layers).
            let ctx = LayoutContext {
                device: ["cpu", "cuda", "npu", "", "ünïcode"][usize::from(*device) % 5].into(),
                page_size: u64::from(*device % 3) + 1,
                ..layout.context().clone()
            };
            let Ok(layout) = Layout::new(layout.parts().clone(), ctx) else {
                return;
            };
            let bytes = kvplan_core::exchange::wire::encode(&layout).expect("encode");
            let decoded = kvplan_core::exchange::wire::decode(&bytes).expect("decode of fresh encoding");
            assert_eq!(decoded, layout, "round trip");
            let mut mutated = bytes.clone();
            for &(at, value) in edits.iter().take(8) {
                if !mutated.is_empty() {
                    let i = usize::from(at) % mutated.len();
                    mutated[i] = value;
                }
            }
            if let Some(cut) = truncate {
                mutated.truncate(usize::from(*cut) % (mutated.len() + 1));
            }
            if *fix_crc && mutated.len() >= 4 {
                let body = mutated.len() - 4;
                let crc = kvplan_core::exchange::wire::crc32(&mutated[..body]);
                mutated[body..].copy_from_slice(&crc.to_le_bytes());
            }
            decode_checked(&mutated);
        }
    }
}

/// Parses a structured input from raw bytes (for replaying corpora outside libFuzzer).
pub fn parse<'a, T: Arbitrary<'a>>(data: &'a [u8]) -> Option<T> {
    T::arbitrary_take_rest(Unstructured::new(data)).ok()
}
