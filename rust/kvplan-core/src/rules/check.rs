//! Every rule that decides whether two layouts can be planned, in one place: entry pairing
//! (by layer id, by role, positional or legacy PP slicing), item sizes, head slicing between TP
//! sizes, token plans between page sizes or memory orders, and caller fragments. A template is
//! built only from pairs this module accepts, and `check_pairs` reports exactly what
//! `Template::new` would refuse, so a compatibility report never disagrees with a template.

use std::collections::{HashMap, HashSet};

use crate::error::{HeadProblem, PlanError, Result, Side};
use crate::model::pieces::{Fragment, Fragments, PairSpec};
use crate::peer::entry::Indexing;
use crate::peer::layout::{AttentionGeometry, Layout, MemoryOrder, is_mha_role, is_sidecar_role};
use crate::rules::heads::HeadSlicing;
use crate::rules::pairing::{
    EntryMetadata, LegacyKind, Pairing, Partner, legacy_pp_pairs, pair_each,
};

/// How to pair the two layouts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TemplateOptions {
    /// How entries pair (by layer id by default).
    pub pairing: Pairing,
    /// Reject requests that would write one destination item twice.
    pub check_dst_overlap: bool,
    /// Every prefill rank holding a replicated head sends it, not only the elected holder:
    /// when the prefill TP is a multiple of a smaller decode TP, each of a decode rank's
    /// `tp_p / tp_d` writers sends its heads ([`crate::TpSplit::link_every_holder`]; a replica
    /// holds them at the same offsets as the elected holder). Off by default. For a decode
    /// side that expects a share from each writer, e.g. SGLang's staged transfer, whose
    /// decode scatters every writer's share of its staging region. State is unaffected (a
    /// replicated state item still has one writer per decode rank).
    pub replicas_send: bool,
}

pub(crate) fn entry_labels(layout: &Layout) -> Vec<String> {
    (0..layout.n_entries())
        .map(|i| {
            format!(
                "layer {}, role {}",
                layout.layer_label(i),
                layout.role_label(i)
            )
        })
        .collect()
}

/// The pairing verdict for one source entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryCheck {
    /// Page or state entry.
    pub kind: Indexing,
    /// Source entry index.
    pub src_entry: usize,
    /// Its destination partner, when pairing found one.
    pub dst_entry: Option<usize>,
    /// Why the entry cannot be transferred (no partner, list-level pairing failure, or a size
    /// mismatch with its partner); `None` when it is fine.
    pub problem: Option<PlanError>,
}

/// Checks every source entry of `src` against `dst`: page entries first, then state entries,
/// each in layout order. [`crate::Template::new`] fails with the first problem of this list, so a
/// compatibility report built from it never disagrees with the template.
pub fn check_pairs(src: &Layout, dst: &Layout, options: TemplateOptions) -> Vec<EntryCheck> {
    check_pairs_sliced(
        src,
        dst,
        options,
        &HeadSlicing::between(src, dst, options.replicas_send),
    )
}

/// [`check_pairs`] with the layouts' head slicing already derived (`Template::new` derives it
/// once and keeps it).
pub(crate) fn check_pairs_sliced(
    src: &Layout,
    dst: &Layout,
    options: TemplateOptions,
    heads: &Result<Option<HeadSlicing>>,
) -> Vec<EntryCheck> {
    let state_options = TemplateOptions {
        pairing: options.pairing.for_state(),
        ..options
    };
    let mut checks = check_kind(src, dst, Indexing::Page, options, heads);
    if let Some((at, problem)) = sidecar_problem(src, dst, &checks) {
        checks[at].problem.get_or_insert(problem);
    }
    if let Some((at, problem)) = window_problem(src, dst, &checks) {
        checks[at].problem.get_or_insert(problem);
    }
    let state_start = checks.len();
    checks.extend(check_kind(src, dst, Indexing::State, state_options, heads));
    for check in &mut checks[state_start..] {
        if let Some(problem) = ring_problem(src, dst, check) {
            check.problem.get_or_insert(problem);
        }
    }
    checks
}

/// The first page pair whose sliding windows disagree ([`PlanError::WindowMismatch`]), or
/// the first window entry whose window differs from the first one's: a template walks one
/// window (module `tokens`), so every window pair must keep the same number of tokens.
fn window_problem(src: &Layout, dst: &Layout, checks: &[EntryCheck]) -> Option<(usize, PlanError)> {
    let mut first: Option<(usize, u64)> = None;
    for (at, check) in checks.iter().enumerate() {
        let Some(d) = check.dst_entry else { continue };
        let s = check.src_entry;
        let (src_window, dst_window) = (src.entry(s).window(), dst.entry(d).window());
        if src_window != dst_window {
            let problem = PlanError::WindowMismatch {
                src_entry: s,
                dst_entry: d,
                label: format!("layer {}, role {}", src.layer_label(s), src.role_label(s)),
                src_window,
                dst_window,
            };
            return Some((at, problem));
        }
        let Some(w) = src_window else { continue };
        match first {
            None => first = Some((s, w)),
            Some((entry, other)) if other != w => {
                let problem = PlanError::Geometry {
                    what: format!(
                        "window entries {entry} and {s} have sliding windows of {other} and {w} \
                         tokens; a template plans one window size (build one template per \
                         window size)"
                    ),
                };
                return Some((at, problem));
            }
            Some(_) => {}
        }
    }
    None
}

/// Why a state pair cannot be planned as paired: one side keeps a ring of rows per request
/// and the other one slot (module `ring` relays rows between rings of any sizes, not between a
/// ring and a slot).
fn ring_problem(src: &Layout, dst: &Layout, check: &EntryCheck) -> Option<PlanError> {
    let d = check.dst_entry?;
    let s = check.src_entry;
    let (src_ring, dst_ring) = (src.entry(s).ring(), dst.entry(d).ring());
    if src_ring.is_some() == dst_ring.is_some() {
        return None;
    }
    let text = |ring: Option<u64>| {
        ring.map_or_else(
            || "one slot per request".to_owned(),
            |r| format!("a ring of {r} rows per request"),
        )
    };
    Some(PlanError::Geometry {
        what: format!(
            "prefill state entry {s} (layer {}, role {}) keeps {} but its decode partner, entry \
             {d}, keeps {}; a ring pairs only with a ring",
            src.layer_label(s),
            src.role_label(s),
            text(src_ring),
            text(dst_ring)
        ),
    })
}

/// The page entries of `layout`.
fn pages(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    (0..layout.n_entries()).filter(move |&i| {
        #[cfg(test)]
        ENTRIES_VISITED.with(|n| n.set(n.get() + 1));
        layout.entry(i).is_page()
    })
}

// Counts the entries the pairing-completeness rules visit, so a test can check that they do a
// bounded amount of work per entry (a deterministic complexity check, not a timing).
#[cfg(test)]
thread_local! {
    static ENTRIES_VISITED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The first indexer or scale page entry ([`is_sidecar_role`]) without its partner, as the
/// check to carry the problem and the problem: a sidecar whose layer has no KV entry on the
/// same side, or a decode sidecar of a layer the prefill sends but with no sidecar of its own
/// for it (the decode would hold its KV without its indexer or scales: an incomplete transfer),
/// and likewise any decode page entry of a layer the prefill sends that nothing pairs with (a
/// component the prefill does not have).
fn sidecar_problem(
    src: &Layout,
    dst: &Layout,
    checks: &[EntryCheck],
) -> Option<(usize, PlanError)> {
    let layer_of = |layout: &Layout, i: usize| layout.entry(i).layer;
    let sidecar = |layout: &Layout, i: usize| layout.role(i).is_some_and(is_sidecar_role);
    // The check that speaks for a layer: its first page entry's, else the first check.
    let check_of = |layer: i64| {
        checks
            .iter()
            .position(|c| {
                layer_of(src, c.src_entry) == Some(layer)
                    || c.dst_entry.and_then(|d| layer_of(dst, d)) == Some(layer)
            })
            .unwrap_or(0)
    };
    if checks.is_empty() {
        return None;
    }
    // Every lookup below goes through a set built in one pass over the entries: a scan of
    // all entries per entry made reporting incompatible layouts quadratic (minutes at 100k
    // entries).
    for (side, layout) in [(Side::Src, src), (Side::Dst, dst)] {
        let kv_layers: HashSet<(i64, bool)> = pages(layout)
            .filter(|&j| !sidecar(layout, j))
            .filter_map(|j| Some((layer_of(layout, j)?, layout.is_draft(j))))
            .collect();
        for i in pages(layout).filter(|&i| sidecar(layout, i)) {
            let Some(layer) = layer_of(layout, i) else {
                continue;
            };
            if !kv_layers.contains(&(layer, layout.is_draft(i))) {
                return Some((
                    check_of(layer),
                    PlanError::MissingPartner {
                        side,
                        entry: i,
                        layer,
                        role: layout.role_label(i),
                        why: format!("the {side} side has no KV entry of layer {layer}"),
                    },
                ));
            }
        }
    }
    // A decode sidecar, or a decode component of a multi-component layer (e.g. a NoPE and a
    // RoPE buffer per layer) whose role the prefill has no entry of for that layer, needs its
    // partner when the prefill sends the layer: planning the others alone would leave that
    // entry unwritten. (A further decode entry of a role the prefill sends, a second
    // occurrence, pairs by occurrence and is not this rule's.)
    let mut paired = vec![false; dst.n_entries()];
    for d in checks.iter().filter_map(|c| c.dst_entry) {
        paired[d] = true;
    }
    let src_components: HashSet<(Option<i64>, Option<&str>, bool)> = pages(src)
        .map(|i| (layer_of(src, i), src.role(i), src.is_draft(i)))
        .collect();
    let src_has_role =
        |d: usize| src_components.contains(&(layer_of(dst, d), dst.role(d), dst.is_draft(d)));
    let sent_layers: HashSet<(i64, bool)> = (0..dst.n_entries())
        .filter(|&j| paired[j])
        .filter_map(|j| Some((layer_of(dst, j)?, dst.is_draft(j))))
        .collect();
    for d in pages(dst).filter(|&d| !paired[d] && (sidecar(dst, d) || !src_has_role(d))) {
        let Some(layer) = layer_of(dst, d) else {
            continue;
        };
        if sent_layers.contains(&(layer, dst.is_draft(d))) {
            return Some((
                check_of(layer),
                PlanError::MissingPartner {
                    side: Side::Dst,
                    entry: d,
                    layer,
                    role: dst.role_label(d),
                    why: format!(
                        "the prefill sends layer {layer} without a {} entry: the decode would \
                         hold its KV without it",
                        dst.role_label(d)
                    ),
                },
            ));
        }
    }
    None
}

fn check_kind(
    src: &Layout,
    dst: &Layout,
    kind: Indexing,
    options: TemplateOptions,
    heads: &Result<Option<HeadSlicing>>,
) -> Vec<EntryCheck> {
    let src_entries = src.entries_of_kind(kind);
    let dst_entries = dst.entries_of_kind(kind);
    let partners = local_partners(src, dst, &src_entries, &dst_entries, options);
    // Different tokens per page (or memory orders): paired page items differ in size by design
    // (item = page size x token bytes); they must agree per token instead (module `tokens`),
    // unless heads are sliced, where each side's item must be what its own geometry implies
    // (the same check as for page plans).
    let by_token = kind == Indexing::Page && needs_tokens(src, dst);
    src_entries
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let partner = match &partners {
                Ok(list) => list[i].clone(),
                // A list-level failure concerns every entry of the kind.
                Err(problem) => Err(problem.clone()),
            };
            match partner {
                Err(problem) => EntryCheck {
                    kind,
                    src_entry: s,
                    dst_entry: None,
                    problem: Some(problem),
                },
                Ok(j) => {
                    let d = dst_entries[j];
                    let (src_item_len, dst_item_len) =
                        (src.entry(s).item_len, dst.entry(d).item_len);
                    let size_mismatch = || PlanError::SizeMismatch {
                        layer: src.layer_label(s),
                        role: src.role_label(s),
                        src_entry: s,
                        dst_entry: d,
                        src_item_len,
                        dst_item_len,
                    };
                    let head_problem = |problem: HeadProblem| PlanError::HeadMismatch {
                        entry: Some(format!(
                            "layer {}, role {} (src entry {s}, dst entry {d})",
                            src.layer_label(s),
                            src.role_label(s)
                        )),
                        problem,
                    };
                    let split = kind == Indexing::State
                        && (src.entry(s).channels().is_some() || dst.entry(d).channels().is_some());
                    let problem = match (heads, kind) {
                        (Err(problem), Indexing::Page) => Some(problem.clone()),
                        // A TP channel split says how the slot is re-sliced (module
                        // `state_split`), whatever the attention geometry.
                        _ if split => crate::rules::state_split::pair_problem(src, s, dst, d)
                            .map(head_problem),
                        (Ok(Some(_)), _) if src_item_len == 0 => None,
                        (Ok(Some(slicing)), Indexing::Page)
                            if !(by_token && slicing.moves_whole_heads()) =>
                        {
                            let sizes = (src.entry_page_size(s), dst.entry_page_size(d));
                            slicing
                                .check_page_items(src_item_len, dst_item_len, sizes)
                                .err()
                                .map(head_problem)
                        }
                        _ if by_token => pair_problem(src, dst, &pair_spec(src, dst, s, d)),
                        (Ok(Some(slicing)), Indexing::State) => slicing
                            .state_fragment(src_item_len, dst_item_len)
                            .err()
                            .map(head_problem),
                        _ => (src_item_len != dst_item_len).then(size_mismatch),
                    };
                    EntryCheck {
                        kind,
                        src_entry: s,
                        dst_entry: Some(d),
                        problem,
                    }
                }
            }
        })
        .collect()
}

/// Partners of one kind's entries, as positions within `dst_entries`.
fn local_partners(
    src: &Layout,
    dst: &Layout,
    src_entries: &[usize],
    dst_entries: &[usize],
    options: TemplateOptions,
) -> Result<Vec<Partner>> {
    let pairing = options.pairing;
    let (src_ids, src_roles) = metadata_of(src, src_entries, pairing);
    let (dst_ids, dst_roles) = metadata_of(dst, dst_entries, pairing);
    let (n_src, n_dst) = (src_entries.len(), dst_entries.len());
    let legacy = src_ids.is_none() && dst_ids.is_none() && n_src != n_dst;
    match pairing.prefill_start_layer() {
        Some(start) if legacy => {
            // Both peers say which buffer group each entry belongs to (k/v, NPU groups g0/g1…,
            // draft): slice each group on its own, as Ascend's per-group slicing does
            // (docs/semantics.md, Ascend).
            let src_drafts: Vec<bool> = src_entries.iter().map(|&i| src.is_draft(i)).collect();
            if let (Some(src_roles), Some(dst_roles)) = (&src_roles, &dst_roles) {
                let partners = slice_per_role(src_roles, &src_drafts, dst_roles, start)?;
                return Ok(partners.into_iter().map(Ok).collect());
            }
            let kind = match pairing.legacy_kind() {
                Some(kind) => kind,
                None => infer_legacy_kind(src_roles.as_deref(), &src_drafts)?,
            };
            let num_draft = src_drafts.iter().filter(|&&d| d).count();
            let decode_layers = dst.context().num_model_layers.map(|x| x as usize);
            let pairs = legacy_pp_pairs(kind, n_src, n_dst, start, num_draft, decode_layers)?;
            Ok(pairs.into_iter().map(|[_, j]| Ok(j)).collect())
        }
        _ => pair_each(
            EntryMetadata {
                layer_ids: src_ids.as_deref(),
                roles: src_roles.as_deref(),
                n_entries: n_src,
            },
            EntryMetadata {
                layer_ids: dst_ids.as_deref(),
                roles: dst_roles.as_deref(),
                n_entries: n_dst,
            },
            pairing.allow_positional_fallback(),
        ),
    }
}

/// Legacy positional slicing within each role: the prefill's entries of role `r` (in order) go to
/// the decode's entries of role `r` starting at `prefill_start_layer`; draft roles go to the last
/// entries of their role (the decode's draft band), as SGLang's draft tail does.
/// `src_drafts` says which source entries are draft entries.
fn positions_by_role(roles: &[String]) -> HashMap<&str, Vec<usize>> {
    let mut by_role: HashMap<&str, Vec<usize>> = HashMap::new();
    for (j, role) in roles.iter().enumerate() {
        by_role.entry(role.as_str()).or_default().push(j);
    }
    by_role
}

fn slice_per_role(
    src_roles: &[String],
    src_drafts: &[bool],
    dst_roles: &[String],
    start: usize,
) -> Result<Vec<usize>> {
    // Positions of each role on both sides, in layout order (linear in the entry counts).
    let (src_by_role, dst_by_role) = (positions_by_role(src_roles), positions_by_role(dst_roles));
    let mut partners = vec![0; src_roles.len()];
    // Roles in order of first appearance, so the first error reported is deterministic.
    for (i, role) in src_roles.iter().enumerate() {
        let src_positions = &src_by_role[role.as_str()];
        if src_positions[0] != i {
            continue; // not this role's first entry: already handled
        }
        let dst_positions = dst_by_role
            .get(role.as_str())
            .map_or(&[][..], Vec::as_slice);
        let wanted = src_positions.len();
        let offset = if src_drafts[i] {
            dst_positions.len().checked_sub(wanted)
        } else {
            start
                .checked_add(wanted)
                .filter(|&end| end <= dst_positions.len())
                .map(|_| start)
        };
        let Some(offset) = offset else {
            return Err(PlanError::LegacySlice {
                reason: format!(
                    "prefill has {wanted} entries of role {role:?} from layer {start}, decode has only {} entries of that role",
                    dst_positions.len()
                ),
            });
        };
        for (k, &i) in src_positions.iter().enumerate() {
            partners[i] = dst_positions[offset + k];
        }
    }
    Ok(partners)
}

/// The caller's fragments of each page pair, validated once for page and token plans alike
/// (`None`: the whole item; fragments given for every pair pass over elided ones).
///
/// # Errors
/// [`PlanError::Geometry`] for a per-pair list of the wrong length or a fragment that
/// [`check_fragments`] refuses.
pub(crate) fn pair_fragments(
    fragments: &Fragments,
    page_pairs: &[PairSpec],
    src_labels: &[String],
) -> Result<Vec<Option<Vec<Fragment>>>> {
    if let Fragments::PerPair(list) = fragments
        && list.len() != page_pairs.len()
    {
        return Err(PlanError::Geometry {
            what: format!(
                "fragments give {} per-pair lists but the template has {} page pairs",
                list.len(),
                page_pairs.len()
            ),
        });
    }
    let checked = page_pairs.iter().enumerate().map(|(index, pair)| {
        let given = match fragments {
            Fragments::Every(_) if pair.item_len == 0 => None,
            _ => fragments.of_pair(index),
        };
        let label = || src_labels.get(pair.src_entry).cloned().unwrap_or_default();
        given.map_or(Ok(None), |list| check_fragments(index, pair, list, &label))
    });
    checked.collect()
}

/// Validates one pair's fragments: non-empty, each of positive length and inside the item on
/// both sides, no two overlapping on the destination. `None` when the list is exactly the
/// whole item (the default, which may coalesce).
fn check_fragments(
    index: usize,
    pair: &PairSpec,
    list: &[Fragment],
    label: &dyn Fn() -> String,
) -> Result<Option<Vec<Fragment>>> {
    let fail = |what: String| PlanError::Geometry {
        what: format!("page pair {index} ({}): {what}", label()),
    };
    if list.is_empty() {
        return Err(fail(
            "an empty fragment list (give None for the whole item)".into(),
        ));
    }
    let (item, dst_item) = (pair.item_len, pair.dst_item_len);
    for (k, f) in list.iter().enumerate() {
        let inside = |off: u64, item: u64| off.checked_add(f.len).is_some_and(|end| end <= item);
        if f.len == 0 {
            return Err(fail(format!(
                "fragment {k} (src_off {}, dst_off {}, len 0) is empty",
                f.src_off, f.dst_off
            )));
        }
        if !inside(f.src_off, item) || !inside(f.dst_off, dst_item) {
            let size = if item == dst_item {
                format!("{item} bytes")
            } else {
                format!("{item} (src) / {dst_item} (dst) bytes")
            };
            return Err(fail(format!(
                "fragment {k} (src_off {}, dst_off {}, len {}) is not inside the item of {size}",
                f.src_off, f.dst_off, f.len
            )));
        }
    }
    let mut by_dst: Vec<(u64, u64, usize)> = list
        .iter()
        .enumerate()
        .map(|(k, f)| (f.dst_off, f.len, k))
        .collect();
    by_dst.sort_unstable();
    for w in by_dst.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            let (a, b) = (w[0].2.min(w[1].2), w[0].2.max(w[1].2));
            return Err(fail(format!(
                "fragments {a} and {b} overlap on the destination (dst bytes {}..{} and {}..{})",
                list[a].dst_off,
                list[a].dst_off + list[a].len,
                list[b].dst_off,
                list[b].dst_off + list[b].len
            )));
        }
    }
    let whole = [Fragment {
        src_off: 0,
        dst_off: 0,
        len: item,
    }];
    Ok((list != whole || item != dst_item).then(|| list.to_vec()))
}

pub(crate) fn pair_spec(src: &Layout, dst: &Layout, s: usize, d: usize) -> PairSpec {
    PairSpec {
        src_entry: s,
        dst_entry: d,
        src_base: src.entry(s).buffer.0,
        dst_base: dst.entry(d).buffer.0,
        item_len: src.entry(s).item_len,
        dst_item_len: dst.entry(d).item_len,
        src_capacity: src.capacity(s),
        dst_capacity: dst.capacity(d),
        src_stride: src.entry(s).stride,
        dst_stride: dst.entry(d).stride,
    }
}

/// Ids and roles of a subset of entries; `None` when the subset does not publish them
/// (layouts guarantee all-or-none within a kind) or when `pairing` ignores its page ids.
fn metadata_of(
    layout: &Layout,
    entries: &[usize],
    pairing: Pairing,
) -> (Option<Vec<i64>>, Option<Vec<String>>) {
    let of = |i: usize| layout.entry(i);
    let hide_ids = pairing.ignores_page_ids() && entries.first().is_some_and(|&i| of(i).is_page());
    let ids: Option<Vec<i64>> = if hide_ids {
        None
    } else {
        entries.iter().map(|&i| of(i).layer).collect()
    };
    let roles: Vec<String> = entries.iter().map(|&i| of(i).role.clone()).collect();
    let roles = (!roles.is_empty() && roles.iter().all(|r| !r.is_empty())).then_some(roles);
    (ids.filter(|ids| !ids.is_empty()), roles)
}

fn infer_legacy_kind(src_roles: Option<&[String]>, src_drafts: &[bool]) -> Result<LegacyKind> {
    match src_roles {
        Some(roles) if roles.iter().any(|r| is_mha_role(r)) => Ok(LegacyKind::Mha),
        Some(roles) if roles.iter().zip(src_drafts).all(|(r, &d)| r == "kv" || d) => {
            Ok(LegacyKind::Mla)
        }
        _ => Err(PlanError::LegacySlice {
            reason: "peers publish no layer ids and their entry counts differ; say whether the layout is \"mla\" or \"mha\" (legacy_kind)".into(),
        }),
    }
}

/// Whether whole pages cannot be copied as they are: the page sizes differ, one side is
/// token-major and the other head-major, either side deals tokens over decode
/// context-parallel ranks (module `dcp`), either side has sliding-window entries (which move
/// only a request's last tokens) or entries in a pool of their own (indexed by that pool's
/// pages, not the request's). Every page plan between such layouts is a token plan.
pub fn needs_tokens(src: &Layout, dst: &Layout) -> bool {
    src.context().page_size != dst.context().page_size
        || memory_order(src) != memory_order(dst)
        || crate::rules::dcp::dealt_pair(src, dst)
        || src.has_windows()
        || dst.has_windows()
        || src.has_further_pools()
        || dst.has_further_pools()
}

pub(crate) fn memory_order(layout: &Layout) -> MemoryOrder {
    layout
        .context()
        .attention
        .map_or(MemoryOrder::Nhd, |g| g.memory_order)
}

/// Why paired page entries `s` and `d` cannot be planned token by token, if they cannot:
/// items that are not whole tokens, different bytes per token, or a head-major item that
/// disagrees with its geometry. What `check_pairs` reports when the page sizes differ.
fn pair_problem(src: &Layout, dst: &Layout, pair: &PairSpec) -> Option<PlanError> {
    if (pair.item_len, pair.dst_item_len) == (0, 0) {
        return None;
    }
    let label = |side: Side, entry: usize| {
        let layout = side.pick(src, dst);
        format!(
            "layer {}, role {}",
            layout.layer_label(entry),
            layout.role_label(entry)
        )
    };
    // Tokens per item of each entry (a DCP draft item holds a virtual page, module `dcp`).
    let sizes = (
        crate::rules::dcp::tokens_per_item(src, pair.src_entry),
        crate::rules::dcp::tokens_per_item(dst, pair.dst_entry),
    );
    let orders = (memory_order(src), memory_order(dst));
    let attention = (src.context().attention, dst.context().attention);
    whole_tokens(pair, sizes, orders, attention, &label).err()
}

/// `(token bytes, head bytes)` of a pair that moves whole tokens: the same bytes per token on
/// both sides, and, when either side is head-major, heads that agree with the published
/// geometry (a pair of token-major sides counts its whole token as one head).
pub(crate) fn whole_tokens(
    pair: &PairSpec,
    sizes: (u64, u64),
    orders: (MemoryOrder, MemoryOrder),
    attention: (Option<AttentionGeometry>, Option<AttentionGeometry>),
    label: &dyn Fn(Side, usize) -> String,
) -> Result<(u64, u64)> {
    let items = (pair.item_len, pair.dst_item_len);
    let token_bytes = token_bytes(pair, items, sizes, label)?;
    let head = if orders == (MemoryOrder::Nhd, MemoryOrder::Nhd) {
        token_bytes
    } else {
        head_bytes(pair, token_bytes, orders, attention, label)?
    };
    Ok((token_bytes, head))
}

/// Bytes per token of one pair: each item a whole number of tokens, the same on both sides.
fn token_bytes(
    pair: &PairSpec,
    items: (u64, u64),
    sizes: (u64, u64),
    label: &dyn Fn(Side, usize) -> String,
) -> Result<u64> {
    for (side, entry, item, size) in [
        (Side::Src, pair.src_entry, items.0, sizes.0),
        (Side::Dst, pair.dst_entry, items.1, sizes.1),
    ] {
        if !item.is_multiple_of(size) {
            return Err(PlanError::TokenSize {
                side,
                entry,
                label: label(side, entry),
                item_len: item,
                page_size: size,
            });
        }
    }
    let (src_token, dst_token) = (items.0 / sizes.0, items.1 / sizes.1);
    if src_token != dst_token {
        return Err(PlanError::TokenBytes {
            label: label(Side::Src, pair.src_entry),
            src_entry: pair.src_entry,
            dst_entry: pair.dst_entry,
            src_item_len: items.0,
            src_page_size: sizes.0,
            dst_item_len: items.1,
            dst_page_size: sizes.1,
        });
    }
    Ok(src_token)
}

/// Bytes of one head when either side is head-major: both sides that publish a geometry agree
/// on it, a head-major side's tokens are exactly its heads per rank times that, and a token is a
/// whole number of heads.
fn head_bytes(
    pair: &PairSpec,
    token_bytes: u64,
    orders: (MemoryOrder, MemoryOrder),
    attention: (Option<AttentionGeometry>, Option<AttentionGeometry>),
    label: &dyn Fn(Side, usize) -> String,
) -> Result<u64> {
    let fail = |side: Side, entry: usize, heads: u64, head: u64| PlanError::HeadLayout {
        side,
        entry,
        label: label(side, entry),
        token_bytes,
        heads,
        head_bytes: head,
    };
    // A head-major side always publishes its geometry (that is where its order comes from).
    let sides = [
        (Side::Src, pair.src_entry, orders.0, attention.0),
        (Side::Dst, pair.dst_entry, orders.1, attention.1),
    ];
    let head = sides
        .iter()
        .find_map(|&(_, _, order, g)| (order == MemoryOrder::Hnd).then_some(g).flatten())
        .map_or(token_bytes, |g| g.head_bytes());
    for (side, entry, order, geometry) in sides {
        let Some(g) = geometry else { continue };
        let heads = u64::from(g.heads_per_rank);
        let exact = order == MemoryOrder::Nhd || heads * g.head_bytes() == token_bytes;
        if g.head_bytes() != head || !exact || !token_bytes.is_multiple_of(head) {
            return Err(fail(side, entry, heads, g.head_bytes()));
        }
    }
    Ok(head)
}

/// The bytes both rules move, where they agree on the destination: each caller fragment
/// restricted to the bytes `rule` moves (head slicing's fragments). A source byte both move to
/// different places has no defined destination and is refused, naming both.
pub(crate) fn compose(
    user: &[Fragment],
    rule: &[Fragment],
    label: &dyn Fn() -> String,
) -> Result<Vec<Fragment>> {
    let mut out = Vec::new();
    for (k, u) in user.iter().enumerate() {
        for r in rule {
            let overlap = u.src_off < r.src_off + r.len && r.src_off < u.src_off + u.len;
            if !overlap {
                continue;
            }
            let Some(both) = u.agree(r) else {
                let start = u.src_off.max(r.src_off);
                return Err(PlanError::FragmentCombination {
                    why: format!(
                        "{}: fragment {k} (src_off {}, dst_off {}, len {}) sends source byte \
                         {start} to destination byte {}, but head slicing places it at {}: the \
                         two disagree on where the moved heads go",
                        label(),
                        u.src_off,
                        u.dst_off,
                        u.len,
                        u.dst_off + (start - u.src_off),
                        r.dst_off + (start - r.src_off),
                    ),
                });
            };
            out.push(both);
        }
    }
    Ok(out)
}

/// How one side stores a page's tokens, for reading item offsets as token coordinates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenFrame {
    /// Tokens per page.
    pub page_size: u64,
    /// Bytes per token.
    pub token: u64,
    /// Bytes per head (the whole token on a token-major side without heads).
    pub head: u64,
    /// Token-major or head-major.
    pub order: MemoryOrder,
}

impl TokenFrame {
    /// Item byte `b` as (token slot, byte inside the token counted head by head), and the bytes
    /// left before the next token (token-major) or head (head-major) boundary.
    fn locate(&self, b: u64) -> (u64, u64, u64) {
        match self.order {
            MemoryOrder::Nhd => (b / self.token, b % self.token, self.token - b % self.token),
            MemoryOrder::Hnd => {
                let (h, r) = (
                    b / (self.page_size * self.head),
                    b % (self.page_size * self.head),
                );
                let off = r % self.head;
                (r / self.head, h * self.head + off, self.head - off)
            }
        }
    }
}

/// Caller fragments (item offsets) of a page pair as the bytes of one token that a token plan
/// moves for every token: each fragment must keep every byte in its token slot, and every slot
/// must move the same bytes. Items at different page sizes are refused: an item on one side is
/// not an item on the other, so item offsets say nothing about where a token goes.
pub(crate) fn per_token(
    list: &[Fragment],
    frames: (TokenFrame, TokenFrame),
    label: &dyn Fn() -> String,
) -> Result<Vec<Fragment>> {
    let fail = |why: String| PlanError::FragmentCombination {
        why: format!("{}: {why}", label()),
    };
    let (src, dst) = frames;
    if src.page_size != dst.page_size {
        return Err(fail(format!(
            "fragments are byte ranges inside one page's item, but prefill pages hold {} tokens \
             and decode pages {}: an item on one side is not an item on the other, so a \
             fragment's destination is undefined; publish the layouts' attention geometry to \
             move part of every token (head slicing), or plan without fragments",
            src.page_size, dst.page_size
        )));
    }
    let mut slots: Vec<Vec<Fragment>> =
        vec![Vec::new(); usize::try_from(src.page_size).unwrap_or(0)];
    for (k, f) in list.iter().enumerate() {
        let mut at = 0;
        while at < f.len {
            let (s_slot, s_w, s_left) = src.locate(f.src_off + at);
            let (d_slot, d_w, d_left) = dst.locate(f.dst_off + at);
            if s_slot != d_slot {
                return Err(fail(format!(
                    "fragment {k} (src_off {}, dst_off {}, len {}) moves bytes of token slot \
                     {s_slot} to token slot {d_slot}; a token plan (n_tokens given, or different \
                     memory orders) moves each token to its own slot",
                    f.src_off, f.dst_off, f.len
                )));
            }
            let n = s_left.min(d_left).min(f.len - at);
            slots[s_slot as usize].push(Fragment {
                src_off: s_w,
                dst_off: d_w,
                len: n,
            });
            at += n;
        }
    }
    for chunks in &mut slots {
        chunks.sort_unstable_by_key(|f| f.src_off);
        // Merge neighbours contiguous on both sides, so equal byte sets compare equal.
        chunks.dedup_by(|next, last| {
            let joins =
                last.src_off + last.len == next.src_off && last.dst_off + last.len == next.dst_off;
            if joins {
                last.len += next.len;
            }
            joins
        });
    }
    if let Some(slot) = slots.iter().position(|c| *c != slots[0]) {
        let bytes = |c: &[Fragment]| c.iter().map(|f| f.len).sum::<u64>();
        return Err(fail(format!(
            "the fragments do not move the same bytes of every token (token slot 0: {} bytes, \
             token slot {slot}: {} bytes, or at other offsets); a token plan (n_tokens given, or \
             different memory orders) moves every token the same way, so plan whole pages without \
             n_tokens to move item-level fragments",
            bytes(&slots[0]),
            bytes(&slots[slot])
        )));
    }
    Ok(slots.swap_remove(0))
}

// ---------------------------------------------------------------------------------------------
// Descriptor ids in vLLM's NIXL layout (module `nixl_ids`)
// ---------------------------------------------------------------------------------------------

/// The region counts of a descriptor-id request: at least one region, one count per region,
/// none negative.
pub(crate) fn desc_id_regions(counts: &[i64], n_regions: usize) -> Result<()> {
    if n_regions == 0 {
        return Err(PlanError::InvalidLayout {
            what: "descriptor ids: the worker has no descriptor region (num_regions and block_len_per_layer are empty)".into(),
        });
    }
    if counts.len() != n_regions {
        return Err(PlanError::InvalidLayout {
            what: format!(
                "descriptor ids: {} region block counts for {n_regions} descriptor regions",
                counts.len()
            ),
        });
    }
    if let Some((region, count)) = counts.iter().enumerate().find(|&(_, &c)| c < 0) {
        return Err(PlanError::InvalidLayout {
            what: format!("descriptor ids: region {region} has a negative block count {count}"),
        });
    }
    Ok(())
}

/// One region group id per descriptor region.
pub(crate) fn desc_id_region_groups(region_groups: &[i64], n_regions: usize) -> Result<()> {
    if region_groups.len() != n_regions {
        return Err(PlanError::InvalidLayout {
            what: format!(
                "descriptor ids: {} region group ids for {n_regions} descriptor regions",
                region_groups.len()
            ),
        });
    }
    Ok(())
}

/// The KV group that feeds layer-routed region `region`, as an index into the request's groups.
pub(crate) fn desc_id_group(group: i64, region: usize, n_groups: usize) -> Result<usize> {
    usize::try_from(group)
        .ok()
        .filter(|&g| g < n_groups)
        .ok_or_else(|| PlanError::InvalidLayout {
            what: format!(
                "descriptor ids: layer {region} reads KV group {group} but the request has {n_groups} groups"
            ),
        })
}

/// A request that reads every group in every region has at least one group.
pub(crate) fn desc_id_any_group(groups: &[&[i64]]) -> Result<()> {
    if groups.is_empty() {
        return Err(PlanError::InvalidLayout {
            what: "descriptor ids: the request has no KV group".into(),
        });
    }
    Ok(())
}

/// A group with blocks has at least one region (its own or a shared one).
pub(crate) fn desc_id_group_regions(group: usize, n: usize, region_groups: &[i64]) -> Result<()> {
    if n == 0 {
        return Err(PlanError::InvalidLayout {
            what: format!(
                "descriptor ids: KV group {group} has blocks but no descriptor region (region group ids {region_groups:?})"
            ),
        });
    }
    Ok(())
}

/// Every block id of `group` lies in `0..count` of descriptor region `region` and fits vLLM's
/// int32 block ids.
pub(crate) fn desc_id_blocks(
    group: usize,
    blocks: &[i64],
    region: usize,
    count: i64,
) -> Result<()> {
    let limit = count.min(i64::from(i32::MAX) + 1);
    match blocks.iter().position(|&b| b < 0 || b >= limit) {
        None => Ok(()),
        Some(position) => Err(PlanError::DescIdOutOfRegion {
            group,
            position,
            block: blocks[position],
            region,
            count: limit,
        }),
    }
}

/// A byte-copy template refuses a page pair whose two entries publish different KV
/// representations: copying fp8 bytes into a bf16 pool (or int8 into fp8, of equal sizes)
/// would reinterpret every value. Such pairs are planned by a conversion template
/// ([`crate::planners::convert::ConversionTemplate`]). A pair where either side publishes none is
/// checked by its sizes alone, as before representations existed.
///
/// # Errors
/// [`PlanError::Conversion`] naming both representations.
pub(crate) fn same_representations(
    src: &Layout,
    dst: &Layout,
    checks: &[EntryCheck],
) -> Result<()> {
    for check in checks.iter().filter(|c| c.kind == Indexing::Page) {
        let (s, Some(d)) = (check.src_entry, check.dst_entry) else {
            continue;
        };
        if let (Some(rs), Some(rd)) = (src.representation(s), dst.representation(d))
            && rs != rd
        {
            return Err(PlanError::Conversion {
                src_entry: s,
                dst_entry: d,
                label: format!("layer {}, role {}", dst.layer_label(d), dst.role_label(d)),
                src: rs.text(),
                dst: rd.text(),
                why: "a byte copy would reinterpret every value; plan the pair with a \
                      conversion template (kvplan.ConversionTemplate)"
                    .into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::layout::{LayoutContext, LayoutParts};

    fn layout(ids: Vec<i64>, roles: Vec<&str>, base: u64) -> Layout {
        let n = ids.len();
        Layout::new(
            LayoutParts {
                data_ptrs: (0..n as u64).map(|i| base + 1000 * i).collect(),
                data_lens: vec![64; n],
                item_lens: vec![8; n],
                layer_ids: ids.into_iter().map(Some).collect(),
                roles: roles.into_iter().map(ToString::to_string).collect(),
                kinds: vec![],
                drafts: vec![],
            },
            LayoutContext::default(),
        )
        .unwrap()
    }

    /// `layers` layers of a KV entry and an indexer entry each, ids from `first`.
    fn with_indexers(layers: i64, first: i64, base: u64) -> Layout {
        let ids = (first..first + layers).flat_map(|l| [l, l]).collect();
        let roles = (0..layers).flat_map(|_| ["kv", "indexer"]).collect();
        layout(ids, roles, base)
    }

    #[test]
    fn completeness_rules_visit_each_entry_a_bounded_number_of_times() {
        // Every sidecar has its layer's KV entry on its own side (each looked up), and no decode
        // entry is paired (each looked up against the prefill's components): a scan of all
        // entries per entry made this quadratic, minutes at 100k entries.
        let layers = 4_000;
        let src = with_indexers(layers, 0, 1 << 20);
        let dst = with_indexers(layers, 1_000_000, 1 << 40);
        let n = 2 * layers as usize;
        ENTRIES_VISITED.with(|v| v.set(0));
        let checks = check_pairs(&src, &dst, TemplateOptions::default());
        let visited = ENTRIES_VISITED.with(std::cell::Cell::get);
        assert!(
            visited <= 8 * n,
            "{visited} entry visits for {n} entries a side"
        );
        assert_eq!(checks.len(), n);
        assert!(
            checks
                .iter()
                .all(|c| matches!(c.problem, Some(PlanError::MissingLayer { .. })))
        );
    }

    #[test]
    fn completeness_rules_still_find_each_missing_partner() {
        // The set lookups keep the rules: a prefill sidecar without its layer's KV entry, and a
        // decode component of a layer the prefill sends that the prefill lacks.
        let src = layout(vec![0, 0, 1], vec!["kv", "indexer", "indexer"], 1 << 20);
        let dst = layout(
            vec![0, 0, 1, 1],
            vec!["kv", "indexer", "kv", "indexer"],
            1 << 40,
        );
        let (at, problem) = sidecar_problem(
            &src,
            &dst,
            &check_pairs(&src, &dst, TemplateOptions::default()),
        )
        .unwrap();
        assert_eq!(at, 2);
        assert!(matches!(
            problem,
            PlanError::MissingPartner {
                side: Side::Src,
                entry: 2,
                layer: 1,
                ..
            }
        ));
        let src = layout(vec![0, 1], vec!["kv", "kv"], 1 << 20);
        let dst = layout(vec![0, 0, 1], vec!["kv", "rope", "kv"], 1 << 40);
        let (at, problem) = sidecar_problem(
            &src,
            &dst,
            &check_pairs(&src, &dst, TemplateOptions::default()),
        )
        .unwrap();
        assert_eq!(at, 0);
        assert!(matches!(
            problem,
            PlanError::MissingPartner {
                side: Side::Dst,
                entry: 1,
                layer: 0,
                ..
            }
        ));
        // A decode draft component is needed only when the prefill sends that layer's draft.
        let dst = layout(vec![0, 1, 1], vec!["kv", "kv", "draft_rope"], 1 << 40);
        let checks = check_pairs(&src, &dst, TemplateOptions::default());
        assert!(sidecar_problem(&src, &dst, &checks).is_none());
    }
}
