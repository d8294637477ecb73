//! The one error type of the core. Messages reach Python users verbatim, so they say what was
//! wrong and with which values.

/// Which side of a transfer a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefill (source) peer.
    Src,
    /// The decode (destination) peer.
    Dst,
}

impl Side {
    /// The value that belongs to this side: `src` for [`Side::Src`], `dst` for [`Side::Dst`].
    pub fn pick<T>(self, src: T, dst: T) -> T {
        match self {
            Side::Src => src,
            Side::Dst => dst,
        }
    }
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Src => "src",
            Side::Dst => "dst",
        })
    }
}

/// Broad class of an error, so bindings can pick an exception type without matching every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Entries could not be paired.
    Pairing,
    /// An index lies outside its buffer.
    IndexBounds,
    /// Paired entries disagree on item size.
    SizeMismatch,
    /// A layout is malformed.
    Layout,
    /// Memory for a result could not be allocated (bindings raise `MemoryError`).
    Memory,
    /// Any other value error: index arrays of unequal length, arithmetic overflow, an output
    /// buffer too small, inputs changed while planning, malformed wire data.
    Other,
}

/// Why a layout, template or plan could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    #[error("src has {src} indices but dst has {dst}; index arrays must have equal length")]
    LengthMismatch { src: usize, dst: usize },
    #[error("{side} index {index} at position {position} is negative")]
    NegativeIndex {
        side: Side,
        index: i64,
        position: usize,
    },
    #[error(
        "{side} index {index} at position {position} is outside 0..{capacity} of {side} entry {entry} ({label}, item_len {item_len})"
    )]
    IndexOutOfRange {
        side: Side,
        index: i64,
        position: usize,
        capacity: u64,
        entry: usize,
        label: String,
        item_len: u64,
    },
    #[error(
        "dst index {index} appears at positions {first} and {second}: a destination item would be written twice"
    )]
    DuplicateDestination {
        index: i64,
        first: usize,
        second: usize,
    },
    #[error(
        "requests {first} and {second} of the batch both write dst {what} {index}: a destination would be written twice"
    )]
    RequestsOverlap {
        what: &'static str,
        index: i64,
        first: usize,
        second: usize,
    },
    /// A batch given flat (all requests' pages concatenated, with offsets) whose offsets or
    /// per-request values do not describe the arrays; `what` names the values.
    #[error("flat batch: {what}")]
    FlatBatch { what: String },
    #[error("request {request} of the batch: {source}")]
    InRequest {
        request: usize,
        source: Box<PlanError>,
    },
    #[error(
        "Layer metadata must be provided by both PD peers or neither (src has {src_ids} ids, dst has {dst_ids})"
    )]
    OneSidedMetadata { src_ids: usize, dst_ids: usize },
    #[error(
        "Layer metadata length must match transfer entries: src metadata={src_ids} entries={n_src}, dst metadata={dst_ids} entries={n_dst}"
    )]
    MetadataLength {
        src_ids: usize,
        n_src: usize,
        dst_ids: usize,
        n_dst: usize,
    },
    #[error(
        "role metadata length must match transfer entries: {side} roles={roles} entries={entries}"
    )]
    RoleLength {
        side: Side,
        roles: usize,
        entries: usize,
    },
    #[error(
        "Decode peer is missing a transfer entry for model layer {layer}{role} (src entry {src_entry}, occurrence {occurrence})"
    )]
    MissingLayer {
        layer: i64,
        role: String,
        src_entry: usize,
        occurrence: usize,
    },
    #[error(
        "Decode peer has no entry of role {role:?} for src entry {src_entry} (occurrence {occurrence} of that role; the decode has {dst_count}): without layer ids, entries pair by position within their role"
    )]
    MissingRole {
        role: String,
        src_entry: usize,
        occurrence: usize,
        dst_count: usize,
    },
    /// An indexer or scale entry whose KV entry is missing (on its own side, or on the other
    /// side while its layer is transferred).
    #[error(
        "{side} entry {entry} (layer {layer}, role {role}) belongs to its layer's KV entry, but {why}"
    )]
    MissingPartner {
        side: Side,
        entry: usize,
        layer: i64,
        role: String,
        why: String,
    },
    #[error(
        "PP-heterogeneous transfer requires layer ids on both peers; got src={n_src} dst={n_dst} entries"
    )]
    PositionalCount { n_src: usize, n_dst: usize },
    #[error("legacy positional slicing: {reason}")]
    LegacySlice { reason: String },
    #[error(
        "item size mismatch for layer {layer} role {role}: src entry {src_entry} has item_len {src_item_len} bytes, dst entry {dst_entry} has {dst_item_len} bytes"
    )]
    SizeMismatch {
        layer: String,
        role: String,
        src_entry: usize,
        dst_entry: usize,
        src_item_len: u64,
        dst_item_len: u64,
    },
    #[error("layout list {field} has {len} values but data_ptrs has {expected}")]
    ListLength {
        field: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("entry {entry}: base address {base:#x} + {len} bytes overflows u64")]
    BufferOverflow { entry: usize, base: u64, len: u64 },
    #[error(
        "{entries} buffers are not a whole multiple of {layers} layers (groups per layer would be {entries}/{layers}); refusing to truncate"
    )]
    GroupsNotWhole { entries: usize, layers: usize },
    #[error("{what}")]
    InvalidLayout { what: String },
    #[error("address arithmetic overflowed u64 while computing {what}")]
    Overflow { what: &'static str },
    #[error("output buffer holds {have} blocks but the plan needs {need}")]
    OutputTooSmall { have: usize, need: usize },
    /// A pack buffer smaller than the bytes a packed plan gathers into it.
    #[error(
        "pack buffer of {have} bytes is too small: the plan gathers {need} bytes ({blocks} blocks) into it; give a pack buffer of at least {need} bytes"
    )]
    PackTooSmall { need: u64, have: u64, blocks: usize },
    /// A staging region of a staged plan smaller than the bytes the plan places in it.
    #[error(
        "{region} staging region of {have} bytes is too small: {layout} needs {need} bytes; give a region of at least {need} bytes"
    )]
    StagingTooSmall {
        region: &'static str,
        need: u64,
        have: u64,
        layout: String,
    },
    /// Decode staging slots (one per decode attention entry) need every pair of a request to
    /// move the same bytes.
    #[error(
        "staged decode slots need equal bytes per attention entry pair: page pair {first_pair} moves {first_bytes} bytes per entry, page pair {pair} moves {bytes}; plan such a request directly"
    )]
    StagingSlotSizes {
        first_pair: usize,
        first_bytes: u64,
        pair: usize,
        bytes: u64,
    },
    /// Two buffers given to a local copy share memory.
    #[error(
        "{first} overlaps {second}: a local copy needs destination buffers that share no byte with any other buffer given"
    )]
    BuffersOverlap { first: String, second: String },
    #[error("index arrays changed while planning (written by another thread during the call?)")]
    InputChanged,
    #[error("wire data: {what}")]
    Wire { what: String },
    /// Sizes come from requests (runs × pairs, bare counts), so an allocation can fail without
    /// anything being wrong with the process: it is reported, never an abort.
    #[error("cannot allocate {bytes} bytes for {what}")]
    OutOfMemory { what: &'static str, bytes: u128 },
    /// Different tokens per page: an item that is not a whole number of tokens.
    #[error(
        "{side} entry {entry} ({label}): item_len {item_len} bytes is not a whole number of tokens of page_size {page_size}; token-exact planning needs item_len = page_size x bytes per token"
    )]
    TokenSize {
        side: Side,
        entry: usize,
        label: String,
        item_len: u64,
        page_size: u64,
    },
    /// Different tokens per page: paired items that disagree on bytes per token.
    #[error(
        "bytes per token differ for {label}: src entry {src_entry} has item_len {src_item_len} for page_size {src_page_size}, dst entry {dst_entry} has item_len {dst_item_len} for page_size {dst_page_size}; paired items must hold the same bytes per token"
    )]
    TokenBytes {
        label: String,
        src_entry: usize,
        dst_entry: usize,
        src_item_len: u64,
        src_page_size: u64,
        dst_item_len: u64,
        dst_page_size: u64,
    },
    /// A head-major (HND) item whose size disagrees with the published attention geometry.
    #[error(
        "{side} entry {entry} ({label}): {token_bytes} bytes per token do not match the attention geometry ({heads} heads per rank x {head_bytes} bytes per head); head-major items must hold exactly heads_per_rank x head_dim x dtype_size bytes per token, with the same head size on both sides"
    )]
    HeadLayout {
        side: Side,
        entry: usize,
        label: String,
        token_bytes: u64,
        heads: u64,
        head_bytes: u64,
    },
    /// A token request with fewer pages than its tokens need on one side.
    #[error(
        "n_tokens {n_tokens} needs {needed} {side} pages of {page_size} tokens, but {given} were given"
    )]
    TokenCount {
        side: Side,
        n_tokens: u64,
        page_size: u64,
        needed: u64,
        given: usize,
    },
    /// A delta request that skips more tokens than it has.
    #[error(
        "skip_tokens {skip_tokens} is past the request's {n_tokens} tokens (the decode cannot hold more tokens than the request has)"
    )]
    SkipTokens { skip_tokens: u64, n_tokens: u64 },
    /// A template's geometry option (fragments) that does not fit its pairs.
    #[error("{what}")]
    Geometry { what: String },
    /// The two sides' attention geometries cannot be bridged by head slicing (or an entry's
    /// item does not match its side's geometry); `entry` names the pair when one is at fault.
    #[error("head slicing: {}{problem}", entry.as_deref().map(|e| format!("{e}: ")).unwrap_or_default())]
    HeadMismatch {
        entry: Option<String>,
        problem: HeadProblem,
    },
    /// Caller fragments that cannot be combined with how the template moves bytes (a token
    /// plan, head slicing); `why` says exactly which bytes have no defined destination.
    #[error("fragments: {why}")]
    FragmentCombination { why: String },
    /// A template whose transfers prepped descriptor tables (one descriptor per whole page)
    /// cannot express; `why` names the template's property and the path that works.
    #[error("prepped descriptor tables: {why}")]
    NotPreppable { why: String },
    /// A block to digest that does not lie inside one of the buffers given for its side.
    #[error(
        "{side} block {block} at [{addr:#x}, +{len} bytes) does not lie inside one of the \
         {n_buffers} buffers given for that side ({nearest}); every block must lie inside one \
         buffer"
    )]
    BlockOutsideBuffers {
        side: Side,
        block: usize,
        addr: u64,
        len: u64,
        n_buffers: usize,
        nearest: String,
    },
    /// Digest inputs that do not describe a plan (columns of unequal lengths, bad offsets).
    #[error("digest input: {what}")]
    DigestInput { what: String },
    /// A transfer cost value that is not a finite number greater than zero (`value` as given,
    /// formatted: a float is not `Eq`).
    #[error("transfer cost {field} must be a finite number greater than 0, got {value}")]
    InvalidCost { field: &'static str, value: String },
    /// A block id of a descriptor-id request (module `nixl_ids`) outside the descriptors one
    /// region holds: the id would name another region's descriptor.
    #[error(
        "KV group {group}: block id {block} at position {position} is outside 0..{count}, the blocks of descriptor region {region}"
    )]
    DescIdOutOfRegion {
        group: usize,
        position: usize,
        block: i64,
        region: usize,
        count: i64,
    },
    /// Paired page entries that disagree on their sliding window (one a window entry and the
    /// other full, or two window sizes): the decode would hold other tokens than it attends to.
    #[error(
        "prefill entry {src_entry} ({label}) has {} but its decode partner, entry {dst_entry}, has {}; paired entries must keep the same tokens",
        window_text(*src_window),
        window_text(*dst_window)
    )]
    WindowMismatch {
        /// Source entry index.
        src_entry: usize,
        /// Destination entry index.
        dst_entry: usize,
        /// The source entry's layer and role.
        label: String,
        /// The source entry's window in tokens (`None`: full attention).
        src_window: Option<u64>,
        /// The destination entry's window in tokens.
        dst_window: Option<u64>,
    },
}

/// Why head slicing cannot bridge two layouts, or a pair's items, typed so that callers never
/// parse a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadProblem {
    /// A geometry value both sides must share differs.
    #[error(
        "{what} differ (prefill {src}, decode {dst}); heads can only be re-sliced between items of the same shape"
    )]
    Differ {
        what: &'static str,
        src: String,
        dst: String,
    },
    /// Heads cannot be split evenly over a side's ranks, or a rank is outside its TP size.
    #[error("{what}")]
    Split { what: String },
    /// A side publishes heads per rank that do not follow from kv_heads and its TP size.
    #[error(
        "{} publishes heads_per_rank {published} but kv_heads {kv_heads} over TP size {tp} gives {want} per rank",
        side.pick("prefill", "decode")
    )]
    HeadsPerRank {
        side: Side,
        published: u32,
        kv_heads: u32,
        tp: u32,
        want: u32,
    },
    /// Whole items move but their lengths differ.
    #[error(
        "item lengths differ (prefill {src_item}, decode {dst_item} bytes) although both ranks hold the same heads"
    )]
    ItemsDiffer { src_item: u64, dst_item: u64 },
    /// Part of an item moves, and one side's item is not what its geometry implies.
    #[error(
        "a head-sliced transfer needs {} items of page_size {page_size} × {heads} heads × head_dim {head_dim} × {dtype_size} bytes = {want} bytes, this entry has {have}",
        side.pick("prefill", "decode")
    )]
    SlicedItem {
        side: Side,
        page_size: u64,
        heads: u32,
        head_dim: u32,
        dtype_size: u32,
        want: u64,
        have: u64,
    },
    /// State items neither equal (replicated) nor in the TP ratio (sharded).
    #[error(
        "state item lengths prefill {src_item} bytes at TP {tp_p}, decode {dst_item} bytes at TP {tp_d}: neither equal (a replicated state) nor in the TP ratio ({src_item} × {tp_p} = {dst_item} × {tp_d} for a state sharded over TP)"
    )]
    StateRatio {
        src_item: u64,
        tp_p: u64,
        dst_item: u64,
        tp_d: u64,
    },
}

/// "a sliding window of W tokens" or "no window (full attention)".
fn window_text(window: Option<u64>) -> String {
    window.map_or_else(
        || "no window (full attention)".to_owned(),
        |w| format!("a sliding window of {w} tokens"),
    )
}

impl PlanError {
    /// A stable name of the error's variant family, for callers that must tell errors of one
    /// class apart without reading messages (Python's `KvPlanError.kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            PlanError::HeadMismatch { .. } => "head_slicing",
            PlanError::SizeMismatch { .. } => "size_mismatch",
            PlanError::TokenSize { .. } | PlanError::TokenBytes { .. } => "token_size",
            PlanError::HeadLayout { .. } => "head_layout",
            PlanError::FragmentCombination { .. } => "fragments",
            PlanError::Geometry { .. } => "geometry",
            PlanError::NotPreppable { .. } => "not_preppable",
            PlanError::InvalidCost { .. } => "cost",
            PlanError::StagingTooSmall { .. } => "staging_too_small",
            PlanError::StagingSlotSizes { .. } => "staging_slots",
            PlanError::BuffersOverlap { .. } => "buffer_overlap",
            PlanError::RequestsOverlap { .. } => "requests_overlap",
            PlanError::SkipTokens { .. } => "skip_tokens",
            PlanError::MissingPartner { .. } => "missing_partner",
            PlanError::FlatBatch { .. } => "flat_batch",
            PlanError::WindowMismatch { .. } => "window",
            PlanError::InRequest { source, .. } => source.kind(),
            other => match other.class() {
                ErrorClass::Pairing => "pairing",
                ErrorClass::IndexBounds => "index_bounds",
                ErrorClass::Layout => "layout",
                ErrorClass::Memory => "memory",
                ErrorClass::SizeMismatch | ErrorClass::Other => "other",
            },
        }
    }

    /// The error for `count` values of type `T` that could not be allocated.
    pub fn out_of_memory<T>(what: &'static str, count: usize) -> Self {
        PlanError::OutOfMemory {
            what,
            bytes: count as u128 * std::mem::size_of::<T>() as u128,
        }
    }
}

/// `n` copies of `value` in a vector whose allocation may fail (an error naming `what` and the
/// size) instead of aborting the process.
///
/// # Errors
/// [`PlanError::OutOfMemory`].
pub fn try_vec<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| PlanError::out_of_memory::<T>(what, n))?;
    out.resize(n, value);
    Ok(out)
}

impl PlanError {
    /// The broad class of this error (used to choose a Python exception type). Every variant
    /// is listed: a new variant does not compile until it is classified.
    pub fn class(&self) -> ErrorClass {
        match self {
            PlanError::InRequest { source, .. } => source.class(),
            PlanError::OneSidedMetadata { .. }
            | PlanError::MetadataLength { .. }
            | PlanError::RoleLength { .. }
            | PlanError::MissingLayer { .. }
            | PlanError::MissingRole { .. }
            | PlanError::MissingPartner { .. }
            | PlanError::WindowMismatch { .. }
            | PlanError::PositionalCount { .. }
            | PlanError::LegacySlice { .. } => ErrorClass::Pairing,
            PlanError::NegativeIndex { .. }
            | PlanError::IndexOutOfRange { .. }
            | PlanError::DuplicateDestination { .. }
            | PlanError::RequestsOverlap { .. }
            | PlanError::InputChanged
            | PlanError::BlockOutsideBuffers { .. }
            | PlanError::DescIdOutOfRegion { .. } => ErrorClass::IndexBounds,
            PlanError::SizeMismatch { .. }
            | PlanError::HeadMismatch { .. }
            | PlanError::TokenSize { .. }
            | PlanError::TokenBytes { .. }
            | PlanError::HeadLayout { .. }
            | PlanError::PackTooSmall { .. }
            | PlanError::StagingTooSmall { .. }
            | PlanError::StagingSlotSizes { .. } => ErrorClass::SizeMismatch,
            PlanError::ListLength { .. }
            | PlanError::BufferOverflow { .. }
            | PlanError::GroupsNotWhole { .. }
            | PlanError::InvalidLayout { .. } => ErrorClass::Layout,
            PlanError::OutOfMemory { .. } => ErrorClass::Memory,
            PlanError::LengthMismatch { .. }
            | PlanError::FlatBatch { .. }
            | PlanError::Overflow { .. }
            | PlanError::OutputTooSmall { .. }
            | PlanError::Geometry { .. }
            | PlanError::FragmentCombination { .. }
            | PlanError::TokenCount { .. }
            | PlanError::SkipTokens { .. }
            | PlanError::NotPreppable { .. }
            | PlanError::DigestInput { .. }
            | PlanError::InvalidCost { .. }
            | PlanError::BuffersOverlap { .. }
            | PlanError::Wire { .. } => ErrorClass::Other,
        }
    }
}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, PlanError>;
