//! The context a layout is built in: memory order, attention geometry, TP and DCP coordinates.

use crate::error::{PlanError, Result};
use crate::peer::entry::Indexing;

use super::{LayoutParts, invalid};

/// How the tokens and heads of one page are laid out inside a KV item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryOrder {
    /// `[tokens][heads][head_dim]`: one token's heads are contiguous (vLLM's and SGLang's
    /// default).
    Nhd,
    /// `[heads][tokens][head_dim]`: one head's tokens are contiguous.
    Hnd,
}

impl MemoryOrder {
    /// `"NHD"` or `"HND"`, as Python and the wire spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryOrder::Nhd => "NHD",
            MemoryOrder::Hnd => "HND",
        }
    }

    /// Parses [`MemoryOrder::as_str`] output (case-insensitive).
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for any other string.
    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_uppercase().as_str() {
            "NHD" => Ok(MemoryOrder::Nhd),
            "HND" => Ok(MemoryOrder::Hnd),
            _ => Err(PlanError::InvalidLayout {
                what: format!("unknown memory order {name:?}; expected \"NHD\" or \"HND\""),
            }),
        }
    }
}

/// KV heads one rank holds when a model's `total_kv_heads` are split over `tp_size` ranks:
/// `max(1, total_kv_heads / tp_size)` (heads divided over the ranks, one head replicated over
/// several ranks when there are fewer heads than ranks). The one place of the rule: layouts
/// default to it, [`TpSplit`](crate::TpSplit) splits by it, and Python reads it through the
/// bindings. A TP size of 0 (unset) counts as 1.
pub fn heads_per_rank_at(total_kv_heads: u32, tp_size: u32) -> u32 {
    (total_kv_heads / tp_size.max(1)).max(1)
}

/// The attention geometry of a peer's KV items: what a receiver must know to slice heads when
/// the two sides use different tensor-parallel sizes (tokens per page is the context's
/// `page_size`). For MLA the latent is one "head" of `head_dim` elements, replicated on every
/// TP rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionGeometry {
    /// KV heads of the whole model (all TP ranks together).
    pub total_kv_heads: u32,
    /// KV heads this rank holds: `max(1, total_kv_heads / tp_size)` in the usual split.
    pub heads_per_rank: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16, 1 for fp8…).
    pub dtype_size: u32,
    /// Token-major (`NHD`) or head-major (`HND`) items.
    pub memory_order: MemoryOrder,
}

impl AttentionGeometry {
    /// The geometry of one rank of a model with `total_kv_heads` heads over `tp_size` ranks,
    /// with the usual defaults: heads divided over the ranks and replicated when fewer
    /// (`max(1, total_kv_heads / tp_size)`), token-major items.
    pub fn for_rank(
        total_kv_heads: u32,
        head_dim: u32,
        dtype_size: u32,
        tp_size: u32,
        heads_per_rank: Option<u32>,
        memory_order: Option<MemoryOrder>,
    ) -> Self {
        Self {
            total_kv_heads,
            heads_per_rank: heads_per_rank.unwrap_or(heads_per_rank_at(total_kv_heads, tp_size)),
            head_dim,
            dtype_size,
            memory_order: memory_order.unwrap_or(MemoryOrder::Nhd),
        }
    }

    /// Bytes of one head of one token: `head_dim * dtype_size`.
    pub fn head_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.dtype_size)
    }

    /// Bytes of one token of this rank's heads: `heads_per_rank * head_dim * dtype_size`.
    pub(crate) fn token_bytes(&self) -> u64 {
        u64::from(self.heads_per_rank) * self.head_bytes()
    }
}

/// Everything about a peer that is not per entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutContext {
    /// Tokens per page.
    pub page_size: u64,
    /// `cpu`, `cuda` or `npu`.
    pub device: String,
    /// Layers of the whole model (not just this PP stage), when known.
    pub num_model_layers: Option<u64>,
    /// Pipeline-parallel rank of this peer.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Tensor-parallel rank of this peer.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Heads, head size and memory order of the KV items, when the peer publishes them.
    pub attention: Option<AttentionGeometry>,
    /// Decode context parallelism: how the request's tokens are dealt over this peer's
    /// context-parallel ranks (module `dcp`; size 1 = not dealt).
    pub dcp: DcpContext,
}

impl Default for LayoutContext {
    fn default() -> Self {
        Self {
            page_size: 1,
            device: "cpu".into(),
            num_model_layers: None,
            pp_rank: 0,
            pp_size: 1,
            tp_rank: 0,
            tp_size: 1,
            attention: None,
            dcp: DcpContext::default(),
        }
    }
}
/// The attention geometry on its own: every count positive, a rank holding no more heads than
/// the model has.
pub(super) fn check_attention(g: &AttentionGeometry) -> Result<()> {
    for (name, value) in [
        ("kv_heads", g.total_kv_heads),
        ("heads_per_rank", g.heads_per_rank),
        ("head_dim", g.head_dim),
        ("dtype_size", g.dtype_size),
    ] {
        if value == 0 {
            return Err(invalid(format!("{name} must be at least 1, got 0")));
        }
    }
    if g.heads_per_rank > g.total_kv_heads {
        return Err(invalid(format!(
            "heads_per_rank {} exceeds kv_heads {} (the model's KV heads)",
            g.heads_per_rank, g.total_kv_heads
        )));
    }
    Ok(())
}
/// A peer's decode-context-parallel coordinates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DcpContext {
    /// Context-parallel ranks the request's tokens are dealt over (1: not dealt).
    pub size: u32,
    /// This peer's rank, below `size`.
    pub rank: u32,
    /// Consecutive tokens per deal, at least 1.
    pub interleave: u64,
}

impl Default for DcpContext {
    fn default() -> Self {
        Self {
            size: 1,
            rank: 0,
            interleave: 1,
        }
    }
}

impl DcpContext {
    /// Whether tokens are dealt (more than one rank).
    pub fn dealt(&self) -> bool {
        self.size > 1
    }

    /// `"rank r of N (interleave I)"`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "DCP rank {} of {} (interleave {})",
            self.rank, self.size, self.interleave
        )
    }
}

/// The DCP fields of a layout context on their own, and with the entries: rank below size,
/// interleave at least 1, a page that holds whole deals or a deal that holds whole pages, and,
/// when there are draft page entries, deals that divide the page (a draft item is the virtual
/// page of `P·N` tokens, which only then is what the ranks' page `k` cover together).
pub(super) fn check_dcp_context(context: &LayoutContext, parts: &LayoutParts) -> Result<()> {
    let d = context.dcp;
    let invalid = |what: String| PlanError::InvalidLayout { what };
    if d.size == 0 {
        return Err(invalid(
            "dcp_size must be at least 1 (the decode context-parallel ranks that share a \
             request's tokens), got 0"
                .into(),
        ));
    }
    if d.rank >= d.size {
        return Err(invalid(format!(
            "dcp_rank {} must be below dcp_size {}",
            d.rank, d.size
        )));
    }
    if d.interleave == 0 {
        return Err(invalid(
            "dcp_interleave must be at least 1 (tokens per deal)".into(),
        ));
    }
    if !d.dealt() {
        return Ok(());
    }
    let page = context.page_size;
    if !page.is_multiple_of(d.interleave) && !d.interleave.is_multiple_of(page) {
        return Err(invalid(format!(
            "dcp_interleave {} and page_size {page}: one must divide the other (a page holds \
             whole deals, or a deal whole pages)",
            d.interleave
        )));
    }
    u64::from(d.size)
        .checked_mul(page)
        .and_then(|v| v.checked_mul(d.interleave))
        .ok_or(PlanError::Overflow {
            what: "DCP virtual page",
        })?;
    let draft =
        (0..parts.data_ptrs.len()).find(|&i| parts.drafts[i] && parts.kinds[i] == Indexing::Page);
    if let Some(entry) = draft
        && !page.is_multiple_of(d.interleave)
    {
        return Err(invalid(format!(
            "entry {entry} is a draft entry, which DCP does not deal: its item holds the virtual \
             page of page_size x dcp_size tokens, which needs dcp_interleave {} to divide \
             page_size {page}",
            d.interleave
        )));
    }
    Ok(())
}
