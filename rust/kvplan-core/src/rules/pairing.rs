//! Pairing source transfer entries with destination entries.
//!
//! Identity pairing (by global layer id, and by role when both peers publish roles) is the
//! default: it is SGLang's `build_transfer_entry_pairs`, FIFO on repeated ids, extra decode
//! entries allowed. Positional pairing exists for legacy peers that publish no ids, in two
//! forms: SGLang's flat fallback ([`pair_entries`] with `allow_positional_fallback`) and the
//! pipeline-parallel slicing by `prefill_start_layer` ([`legacy_pp_pairs`]), made strict.
//! Whatever the mode, when both peers publish roles an entry only pairs with an entry of the
//! same role (positions are counted within each role).

use std::collections::HashMap;

use crate::error::{PlanError, Result, Side};

/// One pair: `[src_entry_index, dst_entry_index]`.
pub(crate) type EntryPair = [usize; 2];

/// Layer ids and (optionally) roles published by one peer for its entries.
#[derive(Debug, Clone, Copy)]
pub struct EntryMetadata<'a> {
    /// Global layer id per entry; `None` or empty means "not published".
    pub layer_ids: Option<&'a [i64]>,
    /// Role per entry (`k`, `v`, `kv`, a state name…); `None` means "not published".
    pub roles: Option<&'a [String]>,
    /// Number of entries.
    pub n_entries: usize,
}

impl<'a> EntryMetadata<'a> {
    /// Metadata with ids only.
    pub fn ids(layer_ids: Option<&'a [i64]>, n_entries: usize) -> Self {
        Self {
            layer_ids,
            roles: None,
            n_entries,
        }
    }

    fn published_ids(&self) -> Option<&'a [i64]> {
        self.layer_ids.filter(|ids| !ids.is_empty())
    }
}

/// Pairs every source entry with a destination entry.
///
/// Same pairs and the same error conditions as SGLang's `build_transfer_entry_pairs`
/// (docs/semantics.md, Entry pairing), plus: when both peers publish roles, no entry ever pairs with an
/// entry of another role. With ids the key is (layer id, role); without ids (positional
/// pairing) the k-th entry of a role pairs with the k-th entry of that role on the other side.
///
/// # Errors
/// [`PlanError::OneSidedMetadata`], [`PlanError::MetadataLength`], [`PlanError::RoleLength`],
/// [`PlanError::MissingLayer`] or [`PlanError::MissingRole`] (the first source entry without a
/// partner) or [`PlanError::PositionalCount`].
pub fn pair_entries(
    src: EntryMetadata<'_>,
    dst: EntryMetadata<'_>,
    allow_positional_fallback: bool,
) -> Result<Vec<EntryPair>> {
    pair_each(src, dst, allow_positional_fallback)?
        .into_iter()
        .enumerate()
        .map(|(i, partner)| partner.map(|j| [i, j]))
        .collect()
}

/// The partner of one source entry, or why it has none.
pub(crate) type Partner = Result<usize>;

/// Like [`pair_entries`], but reports every source entry: its partner or why it has none, so a
/// compatibility report can list all problems while templates raise the first.
///
/// # Errors
/// Problems that concern the whole list rather than one entry: [`PlanError::OneSidedMetadata`],
/// [`PlanError::MetadataLength`], [`PlanError::RoleLength`], [`PlanError::PositionalCount`].
pub fn pair_each(
    src: EntryMetadata<'_>,
    dst: EntryMetadata<'_>,
    allow_positional_fallback: bool,
) -> Result<Vec<Partner>> {
    if src.n_entries == 0 {
        return Ok(Vec::new());
    }
    let positional = |fallback| pair_positionally(src, dst, fallback);
    match (src.published_ids(), dst.published_ids()) {
        (Some(src_ids), Some(dst_ids)) => pair_by_identity(src_ids, dst_ids, src, dst),
        (None, None) => positional(allow_positional_fallback),
        // One-sided ids with fallback: SGLang treats both sides as unpublished.
        _ if allow_positional_fallback => positional(true),
        (one, other) => Err(PlanError::OneSidedMetadata {
            src_ids: one.map_or(0, <[i64]>::len),
            dst_ids: other.map_or(0, <[i64]>::len),
        }),
    }
}

/// Entry `i` to entry `i`, or, when both peers publish roles, the k-th entry of a role to the
/// k-th entry of the same role: a position says nothing about what an entry holds, and two
/// peers may list the same entries in different orders (K block then V block against K, V per
/// layer), so only the roles can keep K from pairing with V or a draft entry with a model one.
fn pair_positionally(
    src: EntryMetadata<'_>,
    dst: EntryMetadata<'_>,
    allow_fallback: bool,
) -> Result<Vec<Partner>> {
    let (n_src, n_dst) = (src.n_entries, dst.n_entries);
    if n_dst < n_src || (n_src != n_dst && !allow_fallback) {
        return Err(PlanError::PositionalCount { n_src, n_dst });
    }
    let (Some(src_roles), Some(dst_roles)) = (src.roles, dst.roles) else {
        return collect_exact(n_src, (0..n_src).map(Ok));
    };
    check_role_count(Side::Src, src_roles, n_src)?;
    check_role_count(Side::Dst, dst_roles, n_dst)?;
    // Destination positions per role, in layout order, with a read cursor (linear overall).
    let mut queues: HashMap<&str, (Vec<usize>, usize)> = HashMap::new();
    for (j, role) in dst_roles.iter().enumerate() {
        queues.entry(role.as_str()).or_default().0.push(j);
    }
    let mut partners = collect_exact(n_src, std::iter::empty())?;
    for (i, role) in src_roles.iter().enumerate() {
        let (positions, cursor) = queues.entry(role.as_str()).or_default();
        let occurrence = *cursor;
        *cursor += 1;
        partners.push(
            positions
                .get(occurrence)
                .copied()
                .ok_or_else(|| PlanError::MissingRole {
                    role: role.clone(),
                    src_entry: i,
                    occurrence: occurrence + 1,
                    dst_count: positions.len(),
                }),
        );
    }
    Ok(partners)
}

/// Collects `n` items into a vector whose allocation is checked: entry counts reach here from
/// Python as bare integers, and an absurd count must be an error, not an allocation abort
/// (which kills the process) or a capacity-overflow panic.
fn collect_exact<T>(n: usize, items: impl Iterator<Item = T>) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| PlanError::out_of_memory::<EntryPair>("entry pairs", n))?;
    out.extend(items);
    Ok(out)
}

fn pair_by_identity(
    src_ids: &[i64],
    dst_ids: &[i64],
    src: EntryMetadata<'_>,
    dst: EntryMetadata<'_>,
) -> Result<Vec<Partner>> {
    if src_ids.len() != src.n_entries || dst_ids.len() != dst.n_entries {
        return Err(PlanError::MetadataLength {
            src_ids: src_ids.len(),
            n_src: src.n_entries,
            dst_ids: dst_ids.len(),
            n_dst: dst.n_entries,
        });
    }
    // Roles refine the key only when both peers publish them (a peer without roles is an
    // SGLang peer, which pairs K and V purely by occurrence order).
    let (src_roles, dst_roles): (Option<&[String]>, Option<&[String]>) =
        match (src.roles, dst.roles) {
            (Some(s), Some(d)) => {
                check_role_count(Side::Src, s, src.n_entries)?;
                check_role_count(Side::Dst, d, dst.n_entries)?;
                (Some(s), Some(d))
            }
            _ => (None, None),
        };
    // FIFO queue of destination positions per key, in ascending position, with a read cursor.
    // Keys borrow the roles: no string is copied per entry.
    // The cursor also counts the source occurrences of its key, so an entry without a partner
    // knows its occurrence number without rescanning the entries before it (a rescan per
    // missing entry made incompatible layouts quadratic). Keys no destination entry has get an
    // empty queue for the same reason.
    let mut queues: HashMap<EntryKey<'_>, (Vec<usize>, usize)> = HashMap::new();
    for j in 0..dst_ids.len() {
        queues
            .entry(key(dst_roles, dst_ids, j))
            .or_default()
            .0
            .push(j);
    }
    let mut pairs = collect_exact(src_ids.len(), std::iter::empty())?;
    for i in 0..src_ids.len() {
        let wanted = key(src_roles, src_ids, i);
        let (positions, cursor) = queues.entry(wanted).or_default();
        let occurrence = *cursor;
        *cursor += 1;
        pairs.push(
            positions
                .get(occurrence)
                .copied()
                .ok_or_else(|| PlanError::MissingLayer {
                    layer: wanted.0,
                    role: wanted.1.map(|r| format!(" role {r}")).unwrap_or_default(),
                    src_entry: i,
                    occurrence: occurrence + 1,
                }),
        );
    }
    Ok(pairs)
}

/// Layer id, refined by role when both peers publish roles.
type EntryKey<'a> = (i64, Option<&'a str>);

/// The pairing key of entry `i`.
fn key<'a>(roles: Option<&'a [String]>, ids: &[i64], i: usize) -> EntryKey<'a> {
    #[cfg(test)]
    KEYS_BUILT.with(|n| n.set(n.get() + 1));
    (ids[i], roles.map(|r| r[i].as_str()))
}

// Counts key evaluations, so tests can check that identity pairing does a bounded amount of
// work per entry (a deterministic complexity check, not a timing).
#[cfg(test)]
thread_local! {
    pub(crate) static KEYS_BUILT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn check_role_count(side: Side, roles: &[String], entries: usize) -> Result<()> {
    if roles.len() == entries {
        Ok(())
    } else {
        Err(PlanError::RoleLength {
            side,
            roles: roles.len(),
            entries,
        })
    }
}

/// How a legacy peer lays out its entries when it publishes no layer ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LegacyKind {
    /// One entry per layer (MLA latent), optionally followed by draft entries.
    Mla,
    /// All K entries, then all V entries.
    Mha,
}

impl LegacyKind {
    /// `"mla"` or `"mha"`, as Python spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            LegacyKind::Mla => "mla",
            LegacyKind::Mha => "mha",
        }
    }
}

/// Which rule pairs the page entries of two layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PairingMode {
    /// By (global layer id, role), as SGLang's `build_transfer_entry_pairs`; peers without ids
    /// fall back to positional pairing or legacy PP slicing when the [`Pairing`] allows it.
    LayerId,
    /// Page ids are ignored: entry `i` pairs with entry `i` (within each role when both peers
    /// publish roles); extra decode entries are allowed.
    Positional,
    /// Page ids are ignored: strict legacy PP slicing from the prefill stage's first layer
    /// (per role when both peers publish roles).
    Legacy,
}

impl PairingMode {
    /// `"layer_id"`, `"positional"` or `"legacy"`.
    pub fn as_str(self) -> &'static str {
        match self {
            PairingMode::LayerId => "layer_id",
            PairingMode::Positional => "positional",
            PairingMode::Legacy => "legacy",
        }
    }
}

/// How two layouts are paired: a mode plus the settings it uses.
///
/// Whatever the mode, state entries pair by layer id (SGLang pairs state components by id
/// whenever they are published, whichever path the KV pages take).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pairing {
    mode: PairingMode,
    allow_positional_fallback: bool,
    prefill_start_layer: Option<usize>,
    legacy_kind: Option<LegacyKind>,
}

impl Default for Pairing {
    fn default() -> Self {
        Self::by_layer_id(false, None, None)
    }
}

impl Pairing {
    /// Pair by (layer id, role). Peers that publish no ids pair positionally when
    /// `allow_positional_fallback` (SGLang allows this at prefill PP = 1 only), or by legacy PP
    /// slicing from `prefill_start_layer` when their entry counts differ; `legacy_kind` says how
    /// such a peer lays out its entries (inferred from roles when absent).
    pub const fn by_layer_id(
        allow_positional_fallback: bool,
        prefill_start_layer: Option<usize>,
        legacy_kind: Option<LegacyKind>,
    ) -> Self {
        Self {
            mode: PairingMode::LayerId,
            allow_positional_fallback,
            prefill_start_layer,
            legacy_kind,
        }
    }

    /// Ignore the page entries' layer ids and pair by position.
    pub const fn positional() -> Self {
        Self {
            mode: PairingMode::Positional,
            allow_positional_fallback: true,
            prefill_start_layer: None,
            legacy_kind: None,
        }
    }

    /// Ignore the page entries' layer ids and slice strictly from `prefill_start_layer`.
    pub const fn legacy(kind: Option<LegacyKind>, prefill_start_layer: usize) -> Self {
        Self {
            mode: PairingMode::Legacy,
            allow_positional_fallback: false,
            prefill_start_layer: Some(prefill_start_layer),
            legacy_kind: kind,
        }
    }

    /// The mode.
    pub fn mode(self) -> PairingMode {
        self.mode
    }

    /// Whether peers without (usable) ids may pair positionally.
    pub fn allow_positional_fallback(self) -> bool {
        self.allow_positional_fallback
    }

    /// The prefill stage's first layer, for legacy PP slicing.
    pub fn prefill_start_layer(self) -> Option<usize> {
        self.prefill_start_layer
    }

    /// The legacy entry layout, when given.
    pub fn legacy_kind(self) -> Option<LegacyKind> {
        self.legacy_kind
    }

    /// Whether the page entries' layer ids are ignored (positional and legacy modes).
    pub(crate) fn ignores_page_ids(self) -> bool {
        self.mode != PairingMode::LayerId
    }

    /// The pairing of the state entries: by layer id, with the same fallback, never sliced.
    #[must_use]
    pub(crate) fn for_state(self) -> Self {
        Self::by_layer_id(self.allow_positional_fallback, None, None)
    }
}

/// Positional pipeline-parallel slicing for peers that publish no layer ids.
///
/// SGLang's `get_mla_kv_ptrs_with_pp` / `get_mha_kv_ptrs_with_pp` (docs/semantics.md, Legacy
/// PP slicing), made strict: a slice that does not fit, an odd MHA entry count or an empty stage is an
/// error, and the MHA V block starts at the decode's layer count (`decode_num_layers`, or half
/// the decode entries when unknown), never at the modulo heuristic that mis-slices uneven splits.
///
/// # Errors
/// [`PlanError::LegacySlice`] naming the counts involved.
pub fn legacy_pp_pairs(
    kind: LegacyKind,
    n_src: usize,
    n_dst: usize,
    prefill_start_layer: usize,
    num_draft_entries: usize,
    decode_num_layers: Option<usize>,
) -> Result<Vec<EntryPair>> {
    let fail = |reason: String| Err(PlanError::LegacySlice { reason });
    if n_src == 0 {
        return Ok(Vec::new());
    }
    match kind {
        LegacyKind::Mla => {
            if n_src == n_dst {
                // Decode PP equals prefill PP: both lists are stage-local.
                return collect_exact(n_src, (0..n_src).map(|i| [i, i]));
            }
            if num_draft_entries > n_src || num_draft_entries > n_dst {
                return fail(format!(
                    "{num_draft_entries} draft entries but src has {n_src} and dst has {n_dst} entries"
                ));
            }
            let main = n_src - num_draft_entries;
            let dst_main = n_dst - num_draft_entries;
            // checked, not saturating: a saturated end of usize::MAX would pass against a
            // dst_main of usize::MAX and pair the last entry with index n_dst (out of range).
            let end = prefill_start_layer.saturating_add(main);
            if prefill_start_layer
                .checked_add(main)
                .is_none_or(|end| end > dst_main)
            {
                return fail(format!(
                    "prefill stage layers {prefill_start_layer}..{end} do not fit the decode's {dst_main} target entries (src={n_src}, dst={n_dst}, draft={num_draft_entries})"
                ));
            }
            let target = (0..main).map(|i| [i, prefill_start_layer + i]);
            let draft = (0..num_draft_entries).map(|k| [main + k, dst_main + k]);
            collect_exact(n_src, target.chain(draft))
        }
        LegacyKind::Mha => {
            if !n_src.is_multiple_of(2) || !n_dst.is_multiple_of(2) {
                return fail(format!(
                    "MHA layouts hold K entries then V entries, so entry counts must be even (src={n_src}, dst={n_dst})"
                ));
            }
            let (layers, dst_half) = (n_src / 2, n_dst / 2);
            if layers == dst_half {
                return collect_exact(n_src, (0..n_src).map(|i| [i, i]));
            }
            // From counts alone an uneven PP split and appended draft K/V look the same
            // (SGLang's modulo heuristic guesses and silently mis-slices), so the decode's layer
            // count must be known.
            let Some(decode_layers) = decode_num_layers else {
                return fail(format!(
                    "the decode's layer count is needed to find its V block (src={n_src}, dst={n_dst} entries: an uneven PP split and draft entries look alike); publish layer ids, MHA roles or num_model_layers"
                ));
            };
            // checked: a huge count (user input, or a peer's num_model_layers) must not wrap
            // to a small product and let V entries pair far outside the decode's list.
            if decode_layers == 0
                || decode_layers
                    .checked_mul(2)
                    .is_none_or(|k_and_v| k_and_v > n_dst)
            {
                return fail(format!(
                    "decode layer count {decode_layers} does not fit {n_dst} decode entries"
                ));
            }
            let end = prefill_start_layer.saturating_add(layers);
            if end > decode_layers {
                return fail(format!(
                    "prefill stage layers {prefill_start_layer}..{end} exceed the decode's {decode_layers} layers (src={n_src}, dst={n_dst})"
                ));
            }
            let k = (0..layers).map(|l| [l, prefill_start_layer + l]);
            let v = (0..layers).map(|l| [layers + l, decode_layers + prefill_start_layer + l]);
            collect_exact(n_src, k.chain(v))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(
        src: &[i64],
        dst: &[i64],
        n_src: usize,
        n_dst: usize,
        fallback: bool,
    ) -> Result<Vec<EntryPair>> {
        pair_entries(
            EntryMetadata::ids(Some(src), n_src),
            EntryMetadata::ids(Some(dst), n_dst),
            fallback,
        )
    }

    #[test]
    fn worked_example_kv_fifo() {
        assert_eq!(
            pairs(&[3, 7, 3, 7], &[3, 7, 11, 3, 7, 11], 4, 6, false).unwrap(),
            vec![[0, 0], [1, 1], [2, 3], [3, 4]]
        );
    }

    #[test]
    fn worked_example_positional_and_errors() {
        assert_eq!(
            pairs(&[], &[], 3, 5, true).unwrap(),
            vec![[0, 0], [1, 1], [2, 2]]
        );
        assert_eq!(pairs(&[1], &[], 1, 3, true).unwrap(), vec![[0, 0]]);
        assert!(pairs(&[9], &[], 0, 0, false).unwrap().is_empty());
        assert!(matches!(
            pairs(&[1], &[], 1, 1, false),
            Err(PlanError::OneSidedMetadata { .. })
        ));
        assert!(matches!(
            pairs(&[1, 2], &[1, 2, 3], 3, 3, false),
            Err(PlanError::MetadataLength { .. })
        ));
        assert!(matches!(
            pairs(&[1, 9], &[1, 2, 3], 2, 3, false),
            Err(PlanError::MissingLayer { layer: 9, .. })
        ));
        assert!(matches!(
            pairs(&[3, 3, 3], &[3, 3], 3, 2, false),
            Err(PlanError::MissingLayer {
                layer: 3,
                occurrence: 3,
                ..
            })
        ));
        assert!(matches!(
            pairs(&[], &[], 3, 5, false),
            Err(PlanError::PositionalCount { n_src: 3, n_dst: 5 })
        ));
        assert!(matches!(
            pairs(&[], &[], 5, 3, true),
            Err(PlanError::PositionalCount { n_src: 5, n_dst: 3 })
        ));
    }

    #[test]
    fn roles_keep_k_and_v_apart() {
        let roles = |r: &[&str]| r.iter().map(ToString::to_string).collect::<Vec<_>>();
        let (src_roles, dst_roles) = (roles(&["v", "k"]), roles(&["k", "v"]));
        let src = EntryMetadata {
            layer_ids: Some(&[3, 3]),
            roles: Some(&src_roles),
            n_entries: 2,
        };
        let dst = EntryMetadata {
            layer_ids: Some(&[3, 3]),
            roles: Some(&dst_roles),
            n_entries: 2,
        };
        assert_eq!(pair_entries(src, dst, false).unwrap(), vec![[0, 1], [1, 0]]);
    }

    #[test]
    fn missing_partners_cost_one_key_per_entry() {
        // No source id has a partner: every entry is reported missing, each with its
        // occurrence number. That used to rescan all earlier entries per missing entry
        // (quadratic); now each entry's key is built once.
        let n = 5_000;
        let src: Vec<i64> = (0..n as i64).map(|i| i / 2).collect();
        let dst: Vec<i64> = (0..n as i64).map(|i| 1_000_000 + i).collect();
        KEYS_BUILT.with(|k| k.set(0));
        let partners = pair_each(
            EntryMetadata::ids(Some(&src), n),
            EntryMetadata::ids(Some(&dst), n),
            false,
        )
        .unwrap();
        assert_eq!(KEYS_BUILT.with(std::cell::Cell::get), 2 * n);
        assert_eq!(
            partners[3],
            Err(PlanError::MissingLayer {
                layer: 1,
                role: String::new(),
                src_entry: 3,
                occurrence: 2,
            })
        );
        assert!(partners.iter().all(Result::is_err));
    }

    fn role_list(r: &[&str]) -> Vec<String> {
        r.iter().map(ToString::to_string).collect()
    }

    fn positional(
        src_roles: &[String],
        dst_roles: &[String],
        fallback: bool,
    ) -> Result<Vec<EntryPair>> {
        pair_entries(
            EntryMetadata {
                layer_ids: None,
                roles: Some(src_roles),
                n_entries: src_roles.len(),
            },
            EntryMetadata {
                layer_ids: None,
                roles: Some(dst_roles),
                n_entries: dst_roles.len(),
            },
            fallback,
        )
    }

    #[test]
    fn positional_pairing_stays_within_roles() {
        // Decode listed K, V per layer; prefill K block then V block: position i of one is not
        // position i of the other, the k-th K is the k-th K.
        let decode = role_list(&["k", "v", "k", "v"]);
        let prefill = role_list(&["k", "k", "v", "v"]);
        assert_eq!(
            positional(&prefill, &decode, false).unwrap(),
            vec![[0, 0], [1, 2], [2, 1], [3, 3]]
        );
        // Draft entries pair with draft entries only, also with extra decode entries.
        let prefill = role_list(&["kv", "kv", "draft"]);
        let decode = role_list(&["kv", "kv", "kv", "draft"]);
        assert_eq!(
            positional(&prefill, &decode, true).unwrap(),
            vec![[0, 0], [1, 1], [2, 3]]
        );
    }

    #[test]
    fn positional_pairing_refuses_role_count_mismatch() {
        let prefill = role_list(&["kv", "kv", "draft"]);
        let decode = role_list(&["kv", "kv", "kv"]);
        let err = positional(&prefill, &decode, false).unwrap_err();
        assert_eq!(
            err,
            PlanError::MissingRole {
                role: "draft".into(),
                src_entry: 2,
                occurrence: 1,
                dst_count: 0,
            }
        );
        assert!(err.to_string().contains("src entry 2"), "{err}");
        assert_eq!(err.class(), crate::error::ErrorClass::Pairing);
        // Counts are checked first, as without roles.
        assert!(matches!(
            positional(&prefill, &role_list(&["kv"]), true),
            Err(PlanError::PositionalCount { n_src: 3, n_dst: 1 })
        ));
        // Roles that do not cover every entry are refused, not zipped short.
        let short = role_list(&["kv"]);
        assert!(matches!(
            pair_entries(
                EntryMetadata {
                    layer_ids: None,
                    roles: Some(&short),
                    n_entries: 2,
                },
                EntryMetadata {
                    layer_ids: None,
                    roles: Some(&prefill),
                    n_entries: 3,
                },
                true,
            ),
            Err(PlanError::RoleLength {
                side: Side::Src,
                roles: 1,
                entries: 2
            })
        ));
    }

    #[test]
    fn worked_example_mla_pp_slices() {
        assert_eq!(
            legacy_pp_pairs(LegacyKind::Mla, 2, 5, 2, 0, None).unwrap(),
            vec![[0, 2], [1, 3]]
        );
        assert_eq!(
            legacy_pp_pairs(LegacyKind::Mla, 3, 6, 2, 1, None).unwrap(),
            vec![[0, 2], [1, 3], [2, 5]]
        );
        assert_eq!(
            legacy_pp_pairs(LegacyKind::Mla, 2, 2, 5, 0, None).unwrap(),
            vec![[0, 0], [1, 1]]
        );
        assert!(legacy_pp_pairs(LegacyKind::Mla, 2, 5, 4, 0, None).is_err());
    }

    #[test]
    fn worked_example_mha_uneven_split_is_correct() {
        // 15 layers split 7 + 8; decode holds K0..K14 then V0..V14.
        let stage0 = legacy_pp_pairs(LegacyKind::Mha, 14, 30, 0, 0, Some(15)).unwrap();
        assert_eq!(
            stage0[7..],
            (0..7).map(|l| [7 + l, 15 + l]).collect::<Vec<_>>()[..]
        );
        let stage1 = legacy_pp_pairs(LegacyKind::Mha, 16, 30, 7, 0, Some(15)).unwrap();
        assert_eq!(
            stage1[..8],
            (0..8).map(|l| [l, 7 + l]).collect::<Vec<_>>()[..]
        );
        assert_eq!(
            stage1[8..],
            (0..8).map(|l| [8 + l, 22 + l]).collect::<Vec<_>>()[..]
        );
        assert!(legacy_pp_pairs(LegacyKind::Mha, 15, 30, 0, 0, None).is_err());
        assert!(legacy_pp_pairs(LegacyKind::Mha, 16, 30, 8, 0, Some(15)).is_err());
        // Without the decode's layer count the V block is ambiguous: an error, not a guess.
        assert!(legacy_pp_pairs(LegacyKind::Mha, 16, 30, 7, 0, None).is_err());
    }

    #[test]
    fn mha_huge_decode_layer_count_is_an_error_not_a_wrap() {
        // Found by the `pairing` fuzz target: `decode_layers * 2` overflowed (a panic with
        // overflow checks; in release it wrapped to 0, the slice was accepted and V entries
        // paired with decode entry 2**63, which made Template::new index out of bounds).
        for layers in [usize::MAX / 2 + 1, usize::MAX / 2 + 2, usize::MAX] {
            let err = legacy_pp_pairs(LegacyKind::Mha, 2, 4, 0, 0, Some(layers)).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "decode layer count {layers} does not fit 4 decode entries"
                )),
                "{err}"
            );
        }
    }

    #[test]
    fn absurd_entry_counts_are_errors_not_allocation_aborts() {
        // Found while fuzzing the Python API: bare counts of 2**40 (allocation abort, SIGABRT)
        // or 2**63 (capacity-overflow panic) reached these collects.
        for n in [1usize << 60, usize::MAX / 2] {
            // Reported as an allocation failure (MemoryError in Python), not a layout error.
            assert!(matches!(
                legacy_pp_pairs(LegacyKind::Mla, n, n, 0, 0, None),
                Err(PlanError::OutOfMemory { .. })
            ));
            assert!(matches!(
                legacy_pp_pairs(LegacyKind::Mha, 2 * (n / 4), 2 * (n / 4), 0, 0, None),
                Err(PlanError::OutOfMemory { .. })
            ));
            let none = EntryMetadata::ids(None, n);
            let err = pair_entries(none, none, true).unwrap_err();
            assert_eq!(err.class(), crate::error::ErrorClass::Memory, "{err}");
        }
    }

    #[test]
    fn mla_slice_end_past_usize_max_is_an_error() {
        // Found by the Python fuzz run: start + 1 saturated to usize::MAX == dst_main, so
        // (1 src, usize::MAX dst, start usize::MAX) paired entry 0 with dst index n_dst.
        assert!(legacy_pp_pairs(LegacyKind::Mla, 1, usize::MAX, usize::MAX, 0, None).is_err());
        assert_eq!(
            legacy_pp_pairs(LegacyKind::Mla, 1, usize::MAX, usize::MAX - 1, 0, None).unwrap(),
            vec![[0, usize::MAX - 1]]
        );
    }
}
