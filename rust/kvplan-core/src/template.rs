//! A compiled peer pair: entries paired and validated once, ready for per-request planning.

use std::collections::HashMap;

use crate::error::{PlanError, Result, Side};
use crate::layout::{EntryKind, Layout};
use crate::pairing::{EntryMetadata, LegacyKind, Partner, legacy_pp_pairs, pair_each};

/// Everything planning needs about one source/destination entry pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairSpec {
    /// Index of the source entry in the source layout.
    pub src_entry: usize,
    /// Index of the destination entry in the destination layout.
    pub dst_entry: usize,
    /// Source buffer base address.
    pub src_base: u64,
    /// Destination buffer base address.
    pub dst_base: u64,
    /// Bytes per item (equal on both sides; checked at template time).
    pub item_len: u64,
    /// Items the source buffer holds.
    pub src_capacity: u64,
    /// Items the destination buffer holds.
    pub dst_capacity: u64,
}

/// How to pair the two layouts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TemplateOptions {
    /// Pair positionally when only one peer (or neither) publishes ids (SGLang allows this at
    /// prefill PP = 1 only).
    pub allow_positional_fallback: bool,
    /// For peers without ids and with different entry counts: the first layer this prefill
    /// stage owns (SGLang's `prefill_start_layer`), enabling legacy PP slicing.
    pub prefill_start_layer: Option<usize>,
    /// Entry layout of legacy peers; inferred from roles (`k`/`v` means MHA) when absent.
    pub legacy_kind: Option<LegacyKind>,
    /// Reject requests that would write one destination item twice.
    pub check_dst_overlap: bool,
}

/// Validated entry pairs for one (prefill layout, decode layout) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub(crate) page_pairs: Vec<PairSpec>,
    /// Page pairs with a non-zero item length, in order: the ones that emit blocks.
    pub(crate) emitting: Vec<PairSpec>,
    pub(crate) state_pairs: Vec<PairSpec>,
    /// Sum of item lengths over emitting pairs: bytes moved per page index pair.
    pub(crate) bytes_per_page: u64,
    /// Smallest capacity over emitting pairs, per side: every index must lie below it.
    pub(crate) src_limit: u64,
    pub(crate) dst_limit: u64,
    pub(crate) check_dst_overlap: bool,
    /// "layer L, role R" per entry of each side, for error messages.
    src_labels: Vec<String>,
    dst_labels: Vec<String>,
}

impl Template {
    /// Pairs `src` (prefill) entries with `dst` (decode) entries, page entries with page entries
    /// and state entries with state entries, and checks that every pair agrees on item length.
    ///
    /// # Errors
    /// Pairing errors, [`PlanError::SizeMismatch`] naming layer, role and both sizes, or
    /// [`PlanError::Overflow`].
    pub fn new(src: &Layout, dst: &Layout, options: TemplateOptions) -> Result<Self> {
        let checks = check_pairs(src, dst, options);
        if let Some(problem) = checks.iter().find_map(|c| c.problem.clone()) {
            return Err(problem);
        }
        let spec_of = |kind: EntryKind| -> Vec<PairSpec> {
            checks
                .iter()
                .filter(|c| c.kind == kind)
                .filter_map(|c| c.dst_entry.map(|d| pair_spec(src, dst, c.src_entry, d)))
                .collect()
        };
        let (page_pairs, state_pairs) = (spec_of(EntryKind::Page), spec_of(EntryKind::State));
        let emitting: Vec<PairSpec> = page_pairs
            .iter()
            .copied()
            .filter(|p| p.item_len > 0)
            .collect();
        let bytes_per_page = emitting
            .iter()
            .try_fold(0u64, |acc, p| acc.checked_add(p.item_len))
            .ok_or(PlanError::Overflow {
                what: "bytes per page",
            })?;
        let src_limit = emitting
            .iter()
            .map(|p| p.src_capacity)
            .min()
            .unwrap_or(u64::MAX);
        let dst_limit = emitting
            .iter()
            .map(|p| p.dst_capacity)
            .min()
            .unwrap_or(u64::MAX);
        Ok(Self {
            page_pairs,
            emitting,
            state_pairs,
            bytes_per_page,
            src_limit,
            dst_limit,
            check_dst_overlap: options.check_dst_overlap,
            src_labels: entry_labels(src),
            dst_labels: entry_labels(dst),
        })
    }

    /// "layer L, role R" of an entry on one side, for messages.
    pub(crate) fn entry_label(&self, side: Side, entry: usize) -> String {
        let labels = if side == Side::Src {
            &self.src_labels
        } else {
            &self.dst_labels
        };
        labels.get(entry).cloned().unwrap_or_default()
    }

    /// Page-entry pairs in planning order (including elided pairs with `item_len == 0`).
    pub fn page_pairs(&self) -> &[PairSpec] {
        &self.page_pairs
    }

    /// State-entry pairs in planning order.
    pub fn state_pairs(&self) -> &[PairSpec] {
        &self.state_pairs
    }

    /// Page pairs that emit blocks (non-zero item length).
    pub fn emitting_pairs(&self) -> &[PairSpec] {
        &self.emitting
    }

    /// Bytes moved per page index pair (sum of item lengths over emitting pairs).
    pub fn bytes_per_page(&self) -> u64 {
        self.bytes_per_page
    }
}

fn entry_labels(layout: &Layout) -> Vec<String> {
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
    pub kind: EntryKind,
    /// Source entry index.
    pub src_entry: usize,
    /// Its destination partner, when pairing found one.
    pub dst_entry: Option<usize>,
    /// Why the entry cannot be transferred (no partner, list-level pairing failure, or a size
    /// mismatch with its partner); `None` when it is fine.
    pub problem: Option<PlanError>,
}

/// Checks every source entry of `src` against `dst`: page entries first, then state entries,
/// each in layout order. [`Template::new`] fails with the first problem of this list, so a
/// compatibility report built from it never disagrees with the template.
pub fn check_pairs(src: &Layout, dst: &Layout, options: TemplateOptions) -> Vec<EntryCheck> {
    let state_options = TemplateOptions {
        prefill_start_layer: None,
        ..options
    };
    let mut checks = check_kind(src, dst, EntryKind::Page, options);
    checks.extend(check_kind(src, dst, EntryKind::State, state_options));
    checks
}

fn check_kind(
    src: &Layout,
    dst: &Layout,
    kind: EntryKind,
    options: TemplateOptions,
) -> Vec<EntryCheck> {
    let src_entries = src.entries_of_kind(kind);
    let dst_entries = dst.entries_of_kind(kind);
    let partners = local_partners(src, dst, &src_entries, &dst_entries, options);
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
                        (src.parts().item_lens[s], dst.parts().item_lens[d]);
                    let problem = (src_item_len != dst_item_len).then(|| PlanError::SizeMismatch {
                        layer: src.layer_label(s),
                        role: src.role_label(s),
                        src_entry: s,
                        dst_entry: d,
                        src_item_len,
                        dst_item_len,
                    });
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
    let (src_ids, src_roles) = metadata_of(src, src_entries);
    let (dst_ids, dst_roles) = metadata_of(dst, dst_entries);
    let (n_src, n_dst) = (src_entries.len(), dst_entries.len());
    let legacy = src_ids.is_none() && dst_ids.is_none() && n_src != n_dst;
    match options.prefill_start_layer {
        Some(start) if legacy => {
            // Both peers say which buffer group each entry belongs to (k/v, NPU groups g0/g1…,
            // draft): slice each group on its own, as Ascend's per-group slicing does (§5.3).
            if let (Some(src_roles), Some(dst_roles)) = (&src_roles, &dst_roles) {
                let partners = slice_per_role(src_roles, dst_roles, start)?;
                return Ok(partners.into_iter().map(Ok).collect());
            }
            let kind = match options.legacy_kind {
                Some(kind) => kind,
                None => infer_legacy_kind(src_roles.as_deref())?,
            };
            let num_draft = src_roles
                .as_ref()
                .map_or(0, |r| r.iter().filter(|x| x.starts_with("draft")).count());
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
            options.allow_positional_fallback,
        ),
    }
}

/// Legacy positional slicing within each role: the prefill's entries of role `r` (in order) go to
/// the decode's entries of role `r` starting at `prefill_start_layer`; draft roles go to the last
/// entries of their role (the decode's draft band), as SGLang's draft tail does.
fn positions_by_role(roles: &[String]) -> HashMap<&str, Vec<usize>> {
    let mut by_role: HashMap<&str, Vec<usize>> = HashMap::new();
    for (j, role) in roles.iter().enumerate() {
        by_role.entry(role.as_str()).or_default().push(j);
    }
    by_role
}

fn slice_per_role(src_roles: &[String], dst_roles: &[String], start: usize) -> Result<Vec<usize>> {
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
        let offset = if role.starts_with("draft") {
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

fn pair_spec(src: &Layout, dst: &Layout, s: usize, d: usize) -> PairSpec {
    PairSpec {
        src_entry: s,
        dst_entry: d,
        src_base: src.parts().data_ptrs[s],
        dst_base: dst.parts().data_ptrs[d],
        item_len: src.parts().item_lens[s],
        src_capacity: src.capacity(s),
        dst_capacity: dst.capacity(d),
    }
}

/// Ids and roles of a subset of entries; `None` when the subset does not publish them
/// (layouts guarantee all-or-none within a kind).
fn metadata_of(layout: &Layout, entries: &[usize]) -> (Option<Vec<i64>>, Option<Vec<String>>) {
    let parts = layout.parts();
    let ids: Option<Vec<i64>> = entries.iter().map(|&i| parts.layer_ids[i]).collect();
    let roles: Vec<String> = entries.iter().map(|&i| parts.roles[i].clone()).collect();
    let roles = (!roles.is_empty() && roles.iter().all(|r| !r.is_empty())).then_some(roles);
    (ids.filter(|ids| !ids.is_empty()), roles)
}

fn infer_legacy_kind(src_roles: Option<&[String]>) -> Result<LegacyKind> {
    match src_roles {
        Some(roles) if roles.iter().any(|r| r == "k" || r == "v") => Ok(LegacyKind::Mha),
        Some(roles) if roles.iter().all(|r| r == "kv" || r.starts_with("draft")) => Ok(LegacyKind::Mla),
        _ => Err(PlanError::LegacySlice {
            reason: "peers publish no layer ids and their entry counts differ; say whether the layout is \"mla\" or \"mha\" (legacy_kind)".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutContext;

    #[test]
    fn legacy_slicing_is_per_buffer_group() {
        // E23: NPU groups, decode [g0 x4, g1 x4, draft g0, draft g1], prefill stage from layer 2.
        let ctx = LayoutContext::default;
        let roles = |r: &[&str]| r.iter().map(ToString::to_string).collect::<Vec<_>>();
        let parts = |ptrs: Vec<u64>, r: Vec<String>| crate::layout::LayoutParts {
            data_lens: vec![64; ptrs.len()],
            item_lens: vec![8; ptrs.len()],
            data_ptrs: ptrs,
            roles: r,
            ..Default::default()
        };
        let src = Layout::new(
            parts(
                vec![102, 103, 202, 203, 300, 400],
                roles(&["g0", "g0", "g1", "g1", "draft_g0", "draft_g1"]),
            ),
            ctx(),
        )
        .unwrap();
        let dst_roles = roles(&[
            "g0", "g0", "g0", "g0", "g1", "g1", "g1", "g1", "draft_g0", "draft_g1",
        ]);
        let dst = Layout::new(
            parts(
                vec![100, 101, 102, 103, 200, 201, 202, 203, 300, 400],
                dst_roles,
            ),
            ctx(),
        )
        .unwrap();
        let options = TemplateOptions {
            prefill_start_layer: Some(2),
            ..TemplateOptions::default()
        };
        let t = Template::new(&src, &dst, options).unwrap();
        let bases: Vec<u64> = t.page_pairs().iter().map(|p| p.dst_base).collect();
        assert_eq!(bases, vec![102, 103, 202, 203, 300, 400]);
        let too_far = TemplateOptions {
            prefill_start_layer: Some(3),
            ..TemplateOptions::default()
        };
        assert!(matches!(
            Template::new(&src, &dst, too_far),
            Err(PlanError::LegacySlice { .. })
        ));
    }

    fn role_layout(roles: &[&str], ids: Option<Vec<i64>>) -> Layout {
        let n = roles.len();
        Layout::new(
            crate::layout::LayoutParts {
                data_ptrs: (0..n as u64).map(|i| 1000 * (i + 1)).collect(),
                data_lens: vec![64; n],
                item_lens: vec![8; n],
                layer_ids: ids.map_or_else(Vec::new, |v| v.into_iter().map(Some).collect()),
                roles: roles.iter().map(ToString::to_string).collect(),
                kinds: vec![],
            },
            LayoutContext::default(),
        )
        .unwrap()
    }

    #[test]
    fn id_less_pairing_never_pairs_different_roles() {
        // Same counts, no ids, roles on both sides: a decode listed K, V per layer against a
        // prefill listed K block then V block pairs K with K and V with V.
        let prefill = role_layout(&["k", "k", "v", "v"], None);
        let decode = role_layout(&["k", "v", "k", "v"], None);
        let t = Template::new(&prefill, &decode, TemplateOptions::default()).unwrap();
        let pairs: Vec<[usize; 2]> = t
            .page_pairs()
            .iter()
            .map(|p| [p.src_entry, p.dst_entry])
            .collect();
        assert_eq!(pairs, vec![[0, 0], [1, 2], [2, 1], [3, 3]]);
        // A draft entry never pairs with a model entry: refused, and check_pairs (what the
        // compatibility report lists) names the same first problem Template raises.
        let prefill = role_layout(&["kv", "kv", "draft"], None);
        let decode = role_layout(&["kv", "kv", "kv"], None);
        let err = Template::new(&prefill, &decode, TemplateOptions::default()).unwrap_err();
        assert!(
            matches!(&err, PlanError::MissingRole { role, src_entry: 2, .. } if role == "draft")
        );
        let checks = check_pairs(&prefill, &decode, TemplateOptions::default());
        assert_eq!(
            checks[..2].iter().map(|c| c.dst_entry).collect::<Vec<_>>(),
            [Some(0), Some(1)]
        );
        assert_eq!(checks[2].problem, Some(err));
    }

    #[test]
    fn incompatible_template_does_linear_pairing_work() {
        // Every source id lacks a partner: check_pairs reports each entry, building each key
        // once (the missing-entry message used to rescan all earlier entries).
        let n = 20_000;
        let roles = vec!["kv"; n];
        let src = role_layout(&roles, Some((0..n as i64).collect()));
        let dst = role_layout(&roles, Some((0..n as i64).map(|i| i + 1_000_000).collect()));
        crate::pairing::KEYS_BUILT.with(|k| k.set(0));
        let checks = check_pairs(&src, &dst, TemplateOptions::default());
        assert_eq!(crate::pairing::KEYS_BUILT.with(std::cell::Cell::get), 2 * n);
        assert!(
            checks
                .iter()
                .all(|c| matches!(c.problem, Some(PlanError::MissingLayer { .. })))
        );
    }

    #[test]
    fn size_mismatch_names_layer_role_and_sizes() {
        let src = Layout::mla(
            vec![1000],
            vec![160],
            vec![16],
            Some(vec![7]),
            LayoutContext::default(),
        )
        .unwrap();
        let dst = Layout::mla(
            vec![2000, 3000],
            vec![80, 320],
            vec![8, 32],
            Some(vec![3, 7]),
            LayoutContext::default(),
        )
        .unwrap();
        let err = Template::new(&src, &dst, TemplateOptions::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "item size mismatch for layer 7 role kv: src entry 0 has item_len 16 bytes, dst entry 1 has 32 bytes"
        );
    }
}
