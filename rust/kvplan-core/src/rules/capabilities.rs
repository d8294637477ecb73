//! What each planner supports: the request features ([`Feature`]) every planner ([`Planner`])
//! declares in one table ([`SUPPORT`]), and the one check ([`check`]) each planner's entry
//! runs, which refuses an unsupported feature as [`PlanError::Unsupported`] naming both.
//!
//! The table is data so that the documentation ("what works with what") and the bindings
//! read it instead of restating it: a planner that learns a feature changes one row here.

use crate::error::{PlanError, Result};

/// A part of a request (or of the template it is planned on) that not every planner plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Feature {
    /// A delta request: `skip_tokens` K > 0, the decode holds the first K tokens already.
    Delta,
    /// A state slot request (one slot per side), not page lists.
    StateSlot,
    /// A template with sliding-window entries, which move only their window's tokens.
    Window,
    /// A plan walked token by token: `n_tokens` given, or a template whose sides differ in
    /// tokens per page or memory order.
    TokenPlan,
    /// A state slot request that gives the positions it has processed (`n_tokens`), so its
    /// ring-state pairs move their live rows.
    Ring,
    /// A request that gives a further pool a token range of its own (`pool_tokens`).
    PoolRange,
    /// A page request that carries each side's state slot too (a hybrid model's whole
    /// request): its page or token blocks, then its state slots and ring rows.
    PagesWithState,
    /// A template whose state pairs move several byte slices of a slot (state entries with a
    /// TP channel split between different TP sizes), not one block per state pair.
    SlicedState,
}

impl Feature {
    /// Every feature, in the order [`check`] reports the first unsupported one.
    pub const ALL: [Feature; 8] = [
        Feature::Delta,
        Feature::StateSlot,
        Feature::Window,
        Feature::TokenPlan,
        Feature::Ring,
        Feature::PoolRange,
        Feature::PagesWithState,
        Feature::SlicedState,
    ];

    /// The stable name (Python's `UnsupportedError.feature`, the docs' column heading).
    pub const fn name(self) -> &'static str {
        match self {
            Feature::Delta => "delta",
            Feature::StateSlot => "state_slot",
            Feature::Window => "window",
            Feature::TokenPlan => "token_plan",
            Feature::Ring => "ring",
            Feature::PoolRange => "pool_range",
            Feature::PagesWithState => "pages_with_state",
            Feature::SlicedState => "sliced_state",
        }
    }

    /// One line saying what the feature is, for the generated docs.
    pub const fn describe(self) -> &'static str {
        match self {
            Feature::Delta => "`skip_tokens` K > 0: the decode holds the first K tokens",
            Feature::StateSlot => "a state slot request (`plan_state`), not page lists",
            Feature::Window => "a template with sliding-window entries",
            Feature::TokenPlan => {
                "a plan walked token by token: `n_tokens` given, or sides that differ in page \
                 size or memory order"
            }
            Feature::Ring => {
                "a state slot request with `n_tokens`: its ring-state rows (the last \
                 `min(R_p, R_d, n_tokens)` positions)"
            }
            Feature::PoolRange => {
                "a request giving a further pool its own token range (`pool_tokens`)"
            }
            Feature::PagesWithState => {
                "a page request that carries a state slot too (`Request(src, dst, \
                 slot=(s, d))`): pages, then state slots and ring rows"
            }
            Feature::SlicedState => {
                "a template whose state entries declare a TP channel split between different \
                 TP sizes: several byte slices per state pair"
            }
        }
    }

    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A planner: one way of planning a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Planner {
    /// `Template::plan` / `Template::prepare`: the direct plan.
    Plan,
    /// `BatchPlanner`: many requests to one peer in one plan.
    Batch,
    /// `PackPlanner::plan`: a gather into a pack buffer and a network plan.
    Packed,
    /// `PackPlanner::row_gather`: the pack gather as source rows.
    RowGather,
    /// `StagedPlanner`: gather, network between staging regions, scatter.
    Staged,
    /// `RoundsPlanner`: a staged plan in rounds through bounded arenas.
    Rounds,
    /// `DescriptorTables`: prepped tables of whole-page descriptors and indices into them.
    Descriptors,
}

impl Planner {
    /// Every planner, in the table's order.
    pub const ALL: [Planner; 7] = [
        Planner::Plan,
        Planner::Batch,
        Planner::Packed,
        Planner::RowGather,
        Planner::Staged,
        Planner::Rounds,
        Planner::Descriptors,
    ];

    /// The stable name: the Python method that reaches the planner (Python's
    /// `UnsupportedError.planner`).
    pub const fn name(self) -> &'static str {
        match self {
            Planner::Plan => "plan",
            Planner::Batch => "plan_batch",
            Planner::Packed => "plan_packed",
            Planner::RowGather => "plan_row_gather",
            Planner::Staged => "plan_staged",
            Planner::Rounds => "plan_rounds",
            Planner::Descriptors => "descriptor_table",
        }
    }

    /// How the planner's refusals name it in a sentence ("a staged plan plans whole requests").
    const fn phrase(self) -> &'static str {
        match self {
            Planner::Plan => "a direct plan",
            Planner::Batch => "a batch plan",
            Planner::Packed => "a packed plan",
            Planner::RowGather => "a row gather",
            Planner::Staged => "a staged plan",
            Planner::Rounds => "a staged plan in rounds",
            Planner::Descriptors => "prepped descriptor tables",
        }
    }

    /// Whether the planner plans requests with `feature` (its row of [`SUPPORT`]).
    pub const fn supports(self, feature: Feature) -> bool {
        SUPPORT[self as usize].1 & feature.bit() != 0
    }
}

const fn bits(features: &[Feature]) -> u8 {
    let mut out = 0;
    let mut i = 0;
    while i < features.len() {
        out |= features[i].bit();
        i += 1;
    }
    out
}

/// The declaration: per planner (in [`Planner::ALL`]'s order), the features it plans.
pub const SUPPORT: [(Planner, u8); 7] = {
    use Feature::{
        Delta, PagesWithState, PoolRange, Ring, SlicedState, StateSlot, TokenPlan, Window,
    };
    let staged = bits(&[
        StateSlot,
        Window,
        TokenPlan,
        Ring,
        PoolRange,
        PagesWithState,
        SlicedState,
    ]);
    [
        (
            Planner::Plan,
            bits(&[
                Delta,
                StateSlot,
                Window,
                TokenPlan,
                Ring,
                PoolRange,
                PagesWithState,
                SlicedState,
            ]),
        ),
        (
            Planner::Batch,
            bits(&[
                Delta,
                StateSlot,
                Window,
                TokenPlan,
                PoolRange,
                PagesWithState,
                SlicedState,
            ]),
        ),
        (
            Planner::Packed,
            bits(&[Delta, StateSlot, Window, TokenPlan, PoolRange]),
        ),
        (Planner::RowGather, bits(&[TokenPlan])),
        // Packed and staged plans are rewritten from the direct plan's blocks, so a pool's
        // own token range (already in those blocks) needs nothing of their own, and neither
        // do state slots, their TP slices and ring rows: more ranges of blocks after the
        // pages, gathered, sent and scattered like them. (A staged plan whose decode region
        // is laid out in page-entry slots, several writers or prefill PP, has no slot for
        // them and refuses such a request as a geometry error; rounds place by stream offset.)
        (Planner::Staged, staged),
        // Rounds are cut from the staged plan, so they plan exactly what it plans.
        (Planner::Rounds, staged),
        (Planner::Descriptors, bits(&[StateSlot])),
    ]
};

/// What one request asks of a planner: its features and the values the refusal names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Asked {
    pub(crate) features: u8,
    /// The request's `skip_tokens` (a delta request's).
    pub skip_tokens: u64,
    /// The template's window in tokens (a window template's).
    pub window: u64,
    /// Tokens per page on each side (a token plan's).
    pub page_sizes: (u64, u64),
    /// Whether the request itself gave `n_tokens` (a token plan of a page template).
    pub n_tokens_given: bool,
    /// The positions a slot request has processed (a ring request's `n_tokens`).
    pub ring_positions: u64,
    /// The state slot `(src, dst)` a page request carries (a hybrid request's).
    pub state_slot: (i64, i64),
    /// State pairs of the template that move several byte slices of a slot.
    pub sliced_state_pairs: usize,
}

impl Asked {
    /// The same request also asking for `feature` when `present`.
    #[must_use]
    pub const fn with(mut self, feature: Feature, present: bool) -> Self {
        if present {
            self.features |= feature.bit();
        }
        self
    }

    /// Whether the request asks for `feature`.
    pub const fn has(&self, feature: Feature) -> bool {
        self.features & feature.bit() != 0
    }

    fn why(&self, planner: Planner, feature: Feature) -> String {
        let phrase = planner.phrase();
        match feature {
            Feature::Delta => format!(
                "{phrase} plans whole requests; this one skips its first {} tokens (a delta \
                 request): plan it with Template::plan",
                self.skip_tokens
            ),
            Feature::StateSlot => format!("{phrase} plans page lists, not a state slot"),
            Feature::Window => format!(
                "{phrase} moves every token of a request; this template has sliding-window \
                 entries ({} tokens), which move only the window: plan it with Template::plan",
                self.window
            ),
            Feature::TokenPlan => {
                let (src, dst) = self.page_sizes;
                let what = if self.n_tokens_given {
                    "the request gives n_tokens, so it is planned token by token".to_string()
                } else if src == dst {
                    "the prefill and decode layouts store a page's tokens in different memory \
                     orders (NHD and HND)"
                        .to_string()
                } else {
                    format!("prefill pages hold {src} tokens and decode pages {dst}")
                };
                format!(
                    "{what}, so a page's bytes do not land in one page of the other side and \
                     {phrase} cannot express the transfer; plan it token by token with \
                     Template.plan(src_pages, dst_pages) and send the plan with submit(plan)"
                )
            }
            Feature::Ring => format!(
                "{phrase} moves a state slot's slots only; this slot request gives n_tokens {} \
                 (positions processed), which moves its ring-state rows: plan it with \
                 Template::plan",
                self.ring_positions
            ),
            Feature::PoolRange => format!(
                "{phrase} plans one token range for every pool; this request gives a pool its \
                 own (pool_tokens): plan it with Template::plan or plan_batch"
            ),
            Feature::PagesWithState => {
                let (src, dst) = self.state_slot;
                format!(
                    "{phrase} plans page lists or a state slot, not both; this request carries \
                     state slot ({src}, {dst}) with its pages: plan it with Template::plan or \
                     plan_batch, or plan the slot as a request of its own"
                )
            }
            Feature::SlicedState => format!(
                "{phrase} gives each state pair one block per slot; this template moves {} \
                 state pairs as several byte slices (a TP channel split between different TP \
                 sizes): plan its slots with Template::plan or plan_batch",
                self.sliced_state_pairs
            ),
        }
    }
}

/// Refuses the first feature (in [`Feature::ALL`]'s order) that `asked` has and `planner` does
/// not support.
///
/// # Errors
/// [`PlanError::Unsupported`] naming the planner, the feature and the values.
pub fn check(planner: Planner, asked: &Asked) -> Result<()> {
    let refused = asked.features & !SUPPORT[planner as usize].1;
    if refused == 0 {
        return Ok(());
    }
    let Some(feature) = Feature::ALL.into_iter().find(|f| refused & f.bit() != 0) else {
        return Ok(());
    };
    Err(PlanError::Unsupported {
        planner: planner.name(),
        feature: feature.name(),
        why: asked.why(planner, feature),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_planner_in_order() {
        for (i, planner) in Planner::ALL.into_iter().enumerate() {
            assert_eq!(SUPPORT[i].0, planner);
            assert_eq!(planner as usize, i);
        }
        for (i, feature) in Feature::ALL.into_iter().enumerate() {
            assert_eq!(feature as usize, i);
        }
    }

    #[test]
    fn the_direct_plan_supports_every_feature() {
        for feature in Feature::ALL {
            assert!(Planner::Plan.supports(feature), "{feature:?}");
            let asked = Asked::default().with(feature, true);
            assert_eq!(check(Planner::Plan, &asked), Ok(()));
        }
    }

    #[test]
    fn an_unsupported_feature_is_named_with_its_planner() {
        let asked = Asked {
            skip_tokens: 5,
            ..Asked::default()
        }
        .with(Feature::Delta, true)
        .with(Feature::TokenPlan, true);
        let err = check(Planner::Staged, &asked).unwrap_err();
        assert_eq!(
            err,
            PlanError::Unsupported {
                planner: "plan_staged",
                feature: "delta",
                why: "a staged plan plans whole requests; this one skips its first 5 tokens (a \
                      delta request): plan it with Template::plan"
                    .into(),
            }
        );
        assert_eq!(err.kind(), "unsupported");
        assert!(
            err.to_string()
                .starts_with("plan_staged does not support delta: ")
        );
    }
}
