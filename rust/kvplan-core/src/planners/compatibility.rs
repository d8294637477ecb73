//! Compatibility verdicts: whether a prefill and a decode, given by their identities, can be
//! planned as they are, only with a conversion, or not at all, with the reason in words naming
//! both values, before any byte moves.
//!
//! The verdict holds no pairing rule of its own. The semantics (model id, revision, RoPE
//! configuration, draft models, transfer mode, cross-layer flag) must be equal, since equal
//! geometry says nothing about them; everything about the geometry is asked of the one gate:
//! [`Template::new`] (a direct plan), else [`ConversionTemplate::new`] (a conversion plan). So a
//! verdict is plannable exactly when those would build.

use crate::error::PlanError;
use crate::exchange::identity::LayoutIdentity;
use crate::peer::layout::Layout;
use crate::peer_pair::template::Template;
use crate::planners::convert::ConversionTemplate;
use crate::rules::check::{TemplateOptions, memory_order};

/// The three verdicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VerdictKind {
    /// A template plans the pair; the decode receives the prefill's bytes as they are.
    Plannable,
    /// Plannable, but the decode's bytes are not the prefill's bytes as they are: a conversion
    /// between KV representations, or pages re-laid token by token between memory orders.
    PlannableWithConversion,
    /// Not plannable, or plannable bytes that would hold different values.
    Refused,
}

impl VerdictKind {
    /// `"plannable"`, `"plannable_with_conversion"` or `"refused"`.
    pub fn as_str(self) -> &'static str {
        match self {
            VerdictKind::Plannable => "plannable",
            VerdictKind::PlannableWithConversion => "plannable_with_conversion",
            VerdictKind::Refused => "refused",
        }
    }
}

/// A compatibility verdict and its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Which verdict.
    pub kind: VerdictKind,
    /// Why, in words, naming the prefill's and the decode's values.
    pub reason: String,
    /// What refused it: `"semantics"`, or the planner error's family
    /// ([`PlanError::kind`]); `None` when plannable.
    pub refused_by: Option<&'static str>,
}

impl Verdict {
    /// Whether a plan may be built.
    pub fn plannable(&self) -> bool {
        self.kind != VerdictKind::Refused
    }
}

/// The verdict on `prefill` sending its KV cache to `decode`, each a layout with the identity
/// computed from it ([`LayoutIdentity::new`]), pairing by layer id.
pub fn compatibility(
    prefill: (&Layout, &LayoutIdentity),
    decode: (&Layout, &LayoutIdentity),
) -> Verdict {
    compatibility_with(prefill, decode, TemplateOptions::default())
}

/// As [`compatibility`], with the template options the pair will be planned with.
pub fn compatibility_with(
    (src, prefill): (&Layout, &LayoutIdentity),
    (dst, decode): (&Layout, &LayoutIdentity),
    options: TemplateOptions,
) -> Verdict {
    if let Some((field, ours, theirs)) = prefill.semantics().first_difference(decode.semantics()) {
        return Verdict {
            kind: VerdictKind::Refused,
            reason: format!(
                "the prefill's {field} is {ours} and the decode's is {theirs}: caches of equal \
                 geometry would hold different values"
            ),
            refused_by: Some("semantics"),
        };
    }
    match Template::new(src, dst, options) {
        Ok(_) => {
            let orders = (memory_order(src), memory_order(dst));
            if orders.0 == orders.1 {
                Verdict {
                    kind: VerdictKind::Plannable,
                    reason: format!(
                        "a template plans it (prefill class {}, decode class {})",
                        prefill.class_id(),
                        decode.class_id()
                    ),
                    refused_by: None,
                }
            } else {
                Verdict {
                    kind: VerdictKind::PlannableWithConversion,
                    reason: format!(
                        "the prefill's memory order is {} and the decode's is {}: pages are \
                         re-laid token by token",
                        orders.0.as_str(),
                        orders.1.as_str()
                    ),
                    refused_by: None,
                }
            }
        }
        Err(direct) => match ConversionTemplate::new(src, dst, options) {
            Ok(conversion) if conversion.converts() => Verdict {
                kind: VerdictKind::PlannableWithConversion,
                reason: format!(
                    "the prefill holds {} and the decode holds {}: a conversion plan converts \
                     them",
                    representations(src),
                    representations(dst)
                ),
                refused_by: None,
            },
            _ => refused(&direct),
        },
    }
}

/// The refusal of the direct template's error, whose message names both values.
fn refused(error: &PlanError) -> Verdict {
    Verdict {
        kind: VerdictKind::Refused,
        reason: format!("no template plans it: {error}"),
        refused_by: Some(error.kind()),
    }
}

/// The distinct representations of a layout's entries, in entry order (`"unpublished"` when
/// none is).
fn representations(layout: &Layout) -> String {
    let mut seen: Vec<String> = Vec::new();
    for entry in layout.entries() {
        let text = entry
            .format
            .map_or_else(|| "unpublished".to_owned(), |f| f.text());
        if !seen.contains(&text) {
            seen.push(text);
        }
    }
    if seen.is_empty() {
        "no entries".to_owned()
    } else {
        seen.join(", ")
    }
}
