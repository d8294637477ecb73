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
    /// The source and destination index arrays of a request differ in length.
    #[error("src has {src} indices but dst has {dst}; index arrays must have equal length")]
    LengthMismatch {
        /// How many source indices were given.
        src: usize,
        /// How many destination indices were given.
        dst: usize,
    },
    /// A page (or token) index below zero.
    #[error("{side} index {index} at position {position} is negative")]
    NegativeIndex {
        /// The side whose index array holds it.
        side: Side,
        /// The negative index as given.
        index: i64,
        /// Where it stands in its index array (0-based).
        position: usize,
    },
    /// An index past the last item of the entry it addresses.
    #[error(
        "{side} index {index} at position {position} is outside 0..{capacity} of {side} entry {entry} ({label}, item_len {item_len})"
    )]
    IndexOutOfRange {
        /// The side whose index array holds it.
        side: Side,
        /// The index as given.
        index: i64,
        /// Where it stands in its index array (0-based).
        position: usize,
        /// How many items the entry holds (valid indices are 0..capacity).
        capacity: u64,
        /// The position of the entry in its side's layout.
        entry: usize,
        /// The entry's name for messages (layer id and role).
        label: String,
        /// The entry's item (page) size in bytes.
        item_len: u64,
    },
    /// A destination index that appears twice in one request, so one destination item would be
    /// written by two transfers.
    #[error(
        "dst index {index} appears at positions {first} and {second}: a destination item would be written twice"
    )]
    DuplicateDestination {
        /// The repeated destination index.
        index: i64,
        /// Its first position in the destination index array.
        first: usize,
        /// Its second position in the destination index array.
        second: usize,
    },
    /// Two requests of one batch that write the same destination page or state slot.
    #[error(
        "requests {first} and {second} of the batch both write dst {what} {index}: a destination would be written twice"
    )]
    RequestsOverlap {
        /// What is written twice: `"page"` or `"state slot"`.
        what: &'static str,
        /// The destination page index or slot written twice.
        index: i64,
        /// The position of the first request in the batch.
        first: usize,
        /// The position of the second request in the batch.
        second: usize,
    },
    /// A batch given flat (all requests' pages concatenated, with offsets) whose offsets or
    /// per-request values do not describe the arrays; `what` names the values.
    #[error("flat batch: {what}")]
    FlatBatch {
        /// What is wrong, naming the offsets or values.
        what: String,
    },
    /// Failed blocks that do not describe a plan's blocks (a range reversed or past the plan,
    /// columns of unequal lengths, requests that are not the batch's); `what` names the values.
    #[error("failed blocks: {what}")]
    FailedBlocks {
        /// What is wrong, naming the ranges or counts.
        what: String,
    },
    /// An error found in one request of a batch; the inner error says what.
    #[error("request {request} of the batch: {source}")]
    InRequest {
        /// The position of the request in the batch (0-based).
        request: usize,
        /// The error of that request.
        source: Box<PlanError>,
    },
    /// Layer ids given for one peer's entries but not for the other's.
    #[error(
        "Layer metadata must be provided by both PD peers or neither (src has {src_ids} ids, dst has {dst_ids})"
    )]
    OneSidedMetadata {
        /// How many layer ids the prefill peer gave.
        src_ids: usize,
        /// How many layer ids the decode peer gave.
        dst_ids: usize,
    },
    /// Layer ids whose count differs from the entry count on either peer.
    #[error(
        "Layer metadata length must match transfer entries: src metadata={src_ids} entries={n_src}, dst metadata={dst_ids} entries={n_dst}"
    )]
    MetadataLength {
        /// How many layer ids the prefill peer gave.
        src_ids: usize,
        /// How many entries the prefill layout has.
        n_src: usize,
        /// How many layer ids the decode peer gave.
        dst_ids: usize,
        /// How many entries the decode layout has.
        n_dst: usize,
    },
    /// Entry roles whose count differs from the entry count of that side.
    #[error(
        "role metadata length must match transfer entries: {side} roles={roles} entries={entries}"
    )]
    RoleLength {
        /// The side whose roles are wrong.
        side: Side,
        /// How many roles were given.
        roles: usize,
        /// How many entries that side's layout has.
        entries: usize,
    },
    /// A prefill entry whose layer (and role) the decode peer has no entry for.
    #[error(
        "Decode peer is missing a transfer entry for model layer {layer}{role} (src entry {src_entry}, occurrence {occurrence})"
    )]
    MissingLayer {
        /// The global layer id that has no decode entry.
        layer: i64,
        /// `" role <name>"` when entries pair by role as well, else empty (it is printed right
        /// after the layer id).
        role: String,
        /// The position of the prefill entry in its layout.
        src_entry: usize,
        /// Which entry of that layer and role it is on the prefill side (1 for the first).
        occurrence: usize,
    },
    /// Without layer ids, a prefill entry of a role the decode peer has fewer entries of.
    #[error(
        "Decode peer has no entry of role {role:?} for src entry {src_entry} (occurrence {occurrence} of that role; the decode has {dst_count}): without layer ids, entries pair by position within their role"
    )]
    MissingRole {
        /// The entry role (for example `"k"`).
        role: String,
        /// The position of the prefill entry in its layout.
        src_entry: usize,
        /// Which entry of that role it is on the prefill side.
        occurrence: usize,
        /// How many entries of that role the decode peer has.
        dst_count: usize,
    },
    /// An indexer or scale entry whose KV entry is missing (on its own side, or on the other
    /// side while its layer is transferred).
    #[error(
        "{side} entry {entry} (layer {layer}, role {role}) belongs to its layer's KV entry, but {why}"
    )]
    MissingPartner {
        /// The side of the entry whose partner is missing.
        side: Side,
        /// The position of that entry in its layout.
        entry: usize,
        /// Its global layer id.
        layer: i64,
        /// Its role (an indexer, a scale or another component of its layer).
        role: String,
        /// Where the KV entry was looked for and not found.
        why: String,
    },
    /// Peers without layer ids whose entry counts differ, so entries cannot pair by position.
    #[error(
        "PP-heterogeneous transfer requires layer ids on both peers; got src={n_src} dst={n_dst} entries"
    )]
    PositionalCount {
        /// How many entries the prefill layout has.
        n_src: usize,
        /// How many entries the decode layout has.
        n_dst: usize,
    },
    /// Peers without layer ids whose entries cannot be paired by the legacy positional rules.
    #[error("legacy positional slicing: {reason}")]
    LegacySlice {
        /// Which rule failed, with the counts.
        reason: String,
    },
    /// Two paired entries whose items (pages) differ in size.
    #[error(
        "item size mismatch for layer {layer} role {role}: src entry {src_entry} has item_len {src_item_len} bytes, dst entry {dst_entry} has {dst_item_len} bytes"
    )]
    SizeMismatch {
        /// The layer of the pair, as printed.
        layer: String,
        /// The role of the pair.
        role: String,
        /// The position of the prefill entry in its layout.
        src_entry: usize,
        /// The position of the decode entry in its layout.
        dst_entry: usize,
        /// The prefill entry's item size in bytes.
        src_item_len: u64,
        /// The decode entry's item size in bytes.
        dst_item_len: u64,
    },
    /// A per-entry list of a layout whose length differs from the number of buffers (`data_ptrs`).
    #[error("layout list {field} has {len} values but data_ptrs has {expected}")]
    ListLength {
        /// The name of the list (for example `"data_lens"`).
        field: &'static str,
        /// How many values the list has.
        len: usize,
        /// How many buffers `data_ptrs` names.
        expected: usize,
    },
    /// A buffer whose end (base address plus length) does not fit in 64 bits.
    #[error("entry {entry}: base address {base:#x} + {len} bytes overflows u64")]
    BufferOverflow {
        /// The position of the entry in its layout.
        entry: usize,
        /// The buffer's base address.
        base: u64,
        /// The buffer's length in bytes.
        len: u64,
    },
    /// A buffer count that is not a whole multiple of the layer count, so buffers cannot be split
    /// evenly into per-layer groups.
    #[error(
        "{entries} buffers are not a whole multiple of {layers} layers (groups per layer would be {entries}/{layers}); refusing to truncate"
    )]
    GroupsNotWhole {
        /// How many buffers were given.
        entries: usize,
        /// How many layers the layout has.
        layers: usize,
    },
    /// A malformed layout not covered by a more specific variant.
    #[error("{what}")]
    InvalidLayout {
        /// What is wrong, with the values.
        what: String,
    },
    /// Address or size arithmetic that would overflow 64 bits.
    #[error("address arithmetic overflowed u64 while computing {what}")]
    Overflow {
        /// The quantity being computed.
        what: &'static str,
    },
    /// An output buffer given by the caller that holds fewer blocks than the plan writes.
    #[error("output buffer holds {have} blocks but the plan needs {need}")]
    OutputTooSmall {
        /// How many blocks the buffer holds.
        have: usize,
        /// How many blocks the plan writes.
        need: usize,
    },
    /// A pack buffer smaller than the bytes a packed plan gathers into it.
    #[error(
        "pack buffer of {have} bytes is too small: the plan gathers {need} bytes ({blocks} blocks) into it; give a pack buffer of at least {need} bytes"
    )]
    PackTooSmall {
        /// How many bytes the plan gathers.
        need: u64,
        /// The pack buffer's size in bytes.
        have: u64,
        /// How many blocks the gather has.
        blocks: usize,
    },
    /// A staging region of a staged plan smaller than the bytes the plan places in it.
    #[error(
        "{region} staging region of {have} bytes is too small: {layout} needs {need} bytes; give a region of at least {need} bytes"
    )]
    StagingTooSmall {
        /// Which region: `"prefill"` or `"decode"`.
        region: &'static str,
        /// How many bytes the plan places in it.
        need: u64,
        /// The region's size in bytes.
        have: u64,
        /// What the plan places there (for example the gather of so many blocks).
        layout: String,
    },
    /// Decode staging slots (one per decode attention entry) need every pair of a request to
    /// move the same bytes.
    #[error(
        "staged decode slots need equal bytes per attention entry pair: page pair {first_pair} moves {first_bytes} bytes per entry, page pair {pair} moves {bytes}; plan such a request directly"
    )]
    StagingSlotSizes {
        /// The first page pair of the request.
        first_pair: usize,
        /// The bytes per entry that pair moves.
        first_bytes: u64,
        /// The first page pair that moves a different amount.
        pair: usize,
        /// The bytes per entry that pair moves.
        bytes: u64,
    },
    /// Two buffers given to a local copy share memory.
    #[error(
        "{first} overlaps {second}: a local copy needs destination buffers that share no byte with any other buffer given"
    )]
    BuffersOverlap {
        /// The first buffer, named with its address range.
        first: String,
        /// The buffer it overlaps, named the same way.
        second: String,
    },
    /// Index arrays whose contents changed between the check and the plan, as when another thread
    /// writes them during the call.
    #[error("index arrays changed while planning (written by another thread during the call?)")]
    InputChanged,
    /// Binary layout data (module `wire`) that cannot be decoded.
    #[error("wire data: {what}")]
    Wire {
        /// What is wrong with the data.
        what: String,
    },
    /// Sizes come from requests (runs × pairs, bare counts), so an allocation can fail without
    /// anything being wrong with the process: it is reported, never an abort.
    #[error("cannot allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// How many bytes were asked for.
        bytes: u128,
    },
    /// Different tokens per page: an item that is not a whole number of tokens.
    #[error(
        "{side} entry {entry} ({label}): item_len {item_len} bytes is not a whole number of tokens of page_size {page_size}; token-exact planning needs item_len = page_size x bytes per token"
    )]
    TokenSize {
        /// The side of the entry.
        side: Side,
        /// The position of the entry in its layout.
        entry: usize,
        /// The entry's name for messages.
        label: String,
        /// The entry's item size in bytes.
        item_len: u64,
        /// Tokens per page on that side.
        page_size: u64,
    },
    /// Different tokens per page: paired items that disagree on bytes per token.
    #[error(
        "bytes per token differ for {label}: src entry {src_entry} has item_len {src_item_len} for page_size {src_page_size}, dst entry {dst_entry} has item_len {dst_item_len} for page_size {dst_page_size}; paired items must hold the same bytes per token"
    )]
    TokenBytes {
        /// The pair's name for messages.
        label: String,
        /// The position of the prefill entry in its layout.
        src_entry: usize,
        /// The position of the decode entry in its layout.
        dst_entry: usize,
        /// The prefill item size in bytes.
        src_item_len: u64,
        /// Tokens per page on the prefill side.
        src_page_size: u64,
        /// The decode item size in bytes.
        dst_item_len: u64,
        /// Tokens per page on the decode side.
        dst_page_size: u64,
    },
    /// A head-major (HND) item whose size disagrees with the published attention geometry.
    #[error(
        "{side} entry {entry} ({label}): {token_bytes} bytes per token do not match the attention geometry ({heads} heads per rank x {head_bytes} bytes per head); head-major items must hold exactly heads_per_rank x head_dim x dtype_size bytes per token, with the same head size on both sides"
    )]
    HeadLayout {
        /// The side of the entry.
        side: Side,
        /// The position of the entry in its layout.
        entry: usize,
        /// The entry's name for messages.
        label: String,
        /// Bytes per token of the item (item size over tokens per page).
        token_bytes: u64,
        /// KV heads per rank that side's geometry publishes.
        heads: u64,
        /// Bytes per head per token (head_dim times dtype size).
        head_bytes: u64,
    },
    /// A token request with fewer pages than its tokens need on one side.
    #[error(
        "n_tokens {n_tokens} needs {needed} {side} {list} of {page_size} tokens, but {given} were given"
    )]
    TokenCount {
        /// The side that has too few pages.
        side: Side,
        /// Which of that side's lists: `pages` (the request's) or `window pages` (its window
        /// pool's).
        list: &'static str,
        /// The request's token count.
        n_tokens: u64,
        /// Tokens per page on that side.
        page_size: u64,
        /// How many pages the tokens need.
        needed: u64,
        /// How many pages were given.
        given: usize,
    },
    /// A delta request that skips more tokens than it has.
    #[error(
        "skip_tokens {skip_tokens} is past the request's {n_tokens} tokens (the decode cannot hold more tokens than the request has)"
    )]
    SkipTokens {
        /// How many tokens the request says the decode already holds.
        skip_tokens: u64,
        /// The request's token count.
        n_tokens: u64,
    },
    /// A template's geometry option (fragments) that does not fit its pairs.
    #[error("{what}")]
    Geometry {
        /// What does not fit, with the values.
        what: String,
    },
    /// The two sides' attention geometries cannot be bridged by head slicing (or an entry's
    /// item does not match its side's geometry); `entry` names the pair when one is at fault.
    #[error("head slicing: {}{problem}", entry.as_deref().map(|e| format!("{e}: ")).unwrap_or_default())]
    HeadMismatch {
        /// The pair at fault, named for messages, when the problem is one pair's and not the whole
        /// geometry's.
        entry: Option<String>,
        /// What cannot be bridged.
        problem: HeadProblem,
    },
    /// Caller fragments that cannot be combined with how the template moves bytes (a token
    /// plan, head slicing); `why` says exactly which bytes have no defined destination.
    #[error("fragments: {why}")]
    FragmentCombination {
        /// Which bytes have no defined destination, and why.
        why: String,
    },
    /// A request feature (or a template property) the planner does not plan, as declared in
    /// `capabilities::SUPPORT`: `planner` and `feature` are their stable names.
    #[error("{planner} does not support {feature}: {why}")]
    Unsupported {
        /// The planner's stable name (`plan_staged`, `plan_row_gather`…).
        planner: &'static str,
        /// The feature's stable name (`delta`, `state_slot`, `window`, `token_plan`).
        feature: &'static str,
        /// Why, with the request's values, and the path that plans it.
        why: String,
    },
    /// A layout that does not hold every component of a model's manifest as declared, or a
    /// manifest that cannot be checked: `problems` names each component, its layers and both
    /// values (module `rules::manifest`).
    #[error(
        "model {model}: {}{}",
        ManifestProblem::join(problems),
        notes_text(notes)
    )]
    Manifest {
        /// The manifest's model name.
        model: String,
        /// Every problem found, in manifest order.
        problems: Vec<ManifestProblem>,
        /// What the problems do not say: which fused entry would have held missing parts, which
        /// parts a layout holds beside their fused entry (empty: nothing to add).
        notes: Vec<String>,
    },
    /// A block to digest that does not lie inside one of the buffers given for its side.
    #[error(
        "{side} block {block} at [{addr:#x}, +{len} bytes) does not lie inside one of the \
         {n_buffers} buffers given for that side ({nearest}); every block must lie inside one \
         buffer"
    )]
    BlockOutsideBuffers {
        /// The side of the block's address.
        side: Side,
        /// The position of the block in the plan.
        block: usize,
        /// The block's start address.
        addr: u64,
        /// The block's length in bytes.
        len: u64,
        /// How many buffers were given for that side.
        n_buffers: usize,
        /// The buffer closest to the address, for the message.
        nearest: String,
    },
    /// Digest inputs that do not describe a plan (columns of unequal lengths, bad offsets).
    #[error("digest input: {what}")]
    DigestInput {
        /// What is wrong, with the lengths or offsets.
        what: String,
    },
    /// A transfer cost value that is not a finite number greater than zero (`value` as given,
    /// formatted: a float is not `Eq`).
    #[error("transfer cost {field} must be a finite number greater than 0, got {value}")]
    InvalidCost {
        /// The name of the cost value.
        field: &'static str,
        /// The value as given, formatted.
        value: String,
    },
    /// A block id of a descriptor-id request (module `nixl_ids`) outside the descriptors one
    /// region holds: the id would name another region's descriptor.
    #[error(
        "KV group {group}: block id {block} at position {position} is outside 0..{count}, the blocks of descriptor region {region}"
    )]
    DescIdOutOfRegion {
        /// The KV group of the request.
        group: usize,
        /// Where the block id stands in its array.
        position: usize,
        /// The block id as given.
        block: i64,
        /// The descriptor region the group uses.
        region: usize,
        /// How many blocks that region holds (valid ids are 0..count).
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
    /// Two paired entries publish representations kvplan cannot convert between exactly.
    #[error(
        "prefill entry {src_entry} ({label}) holds {src} and its decode entry {dst_entry} holds {dst}: {why}"
    )]
    Conversion {
        /// The prefill entry.
        src_entry: usize,
        /// The decode entry.
        dst_entry: usize,
        /// Layer and role of the pair.
        label: String,
        /// The prefill representation (`bf16`, `fp8_e4m3:per_token`, ...).
        src: String,
        /// The decode representation.
        dst: String,
        /// Why the pair cannot be converted.
        why: String,
    },
}

/// One way a layout fails a model's manifest (module `rules::manifest`), typed so that callers
/// never parse a message. `layers` lists global layer ids, sorted; messages write them as ranges.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestProblem {
    /// The manifest itself is malformed (a zero size, heads that do not divide the bytes, ...).
    #[error("malformed manifest: {what}")]
    Malformed {
        /// What is wrong, with the value.
        what: String,
    },
    /// The layout is one PP stage of several and no layer range was given for it, so which
    /// layers it must hold is not known.
    #[error(
        "the layout is PP stage {pp_rank} of {pp_size}: give its layer range (the layers this \
         stage holds) to check it"
    )]
    StageRange {
        /// The layout's PP rank.
        pp_rank: u32,
        /// The layout's PP size.
        pp_size: u32,
    },
    /// The layout's model has another layer count than the manifest's model.
    #[error("the layout's model has {layout} layers, the manifest's {manifest}")]
    ModelLayers {
        /// Layers the manifest declares.
        manifest: u64,
        /// Layers the layout publishes (`num_model_layers`).
        layout: u64,
    },
    /// A component the manifest declares has no entry on these layers.
    #[error(
        "missing {indexing} component {role:?} on layers {}",
        layer_ranges(layers)
    )]
    Missing {
        /// The component's role.
        role: String,
        /// `"page"` or `"state"`.
        indexing: &'static str,
        /// The layers without it.
        layers: Vec<i64>,
    },
    /// A component's entries hold items of another size than the manifest gives at this
    /// layout's TP coordinates.
    #[error(
        "component {role:?} on layers {}: item_len {got} bytes, the manifest gives {expected} \
         ({why})",
        layer_ranges(layers)
    )]
    ItemSize {
        /// The component's role.
        role: String,
        /// The layers whose entries differ.
        layers: Vec<i64>,
        /// Bytes of one item the manifest gives here.
        expected: u64,
        /// Bytes of one item the layout holds.
        got: u64,
        /// How the expected size follows from the manifest (per-row bytes, rows, TP share).
        why: String,
    },
    /// A component's entries keep another sliding window (or ring) than the manifest declares.
    #[error(
        "component {role:?} on layers {}: {what} {}, the manifest gives {}",
        layer_ranges(layers),
        tokens_or_none(*got),
        tokens_or_none(*expected)
    )]
    Shape {
        /// The component's role.
        role: String,
        /// The layers whose entries differ.
        layers: Vec<i64>,
        /// `"window"` or `"ring"`.
        what: &'static str,
        /// What the manifest declares (`None`: none).
        expected: Option<u64>,
        /// What the layout holds (`None`: none).
        got: Option<u64>,
    },
    /// Entries of the layout that no component of the manifest declares (another model's
    /// entries, or a role the manifest does not know).
    #[error(
        "{indexing} entries {role:?} on layers {} are not in the manifest",
        layer_ranges(layers)
    )]
    Unexpected {
        /// The entries' role.
        role: String,
        /// `"page"` or `"state"`.
        indexing: &'static str,
        /// Their layers.
        layers: Vec<i64>,
    },
    /// Entries that publish no layer id, so no component can be found among them.
    #[error("{count} entries publish no layer id; a manifest is checked by layer id")]
    NoLayerIds {
        /// How many entries.
        count: usize,
    },
    /// Entries of declared components on layers outside the stage's layer range.
    #[error(
        "component {role:?} has entries on layers {}, outside the stage's layers {start}..{end}",
        layer_ranges(layers)
    )]
    OutsideStage {
        /// The component's role.
        role: String,
        /// The layers outside the range.
        layers: Vec<i64>,
        /// The range's first layer.
        start: i64,
        /// One past the range's last layer.
        end: i64,
    },
}

impl ManifestProblem {
    /// The stable name of the problem's kind (`missing`, `item_size`, ...), for bindings.
    pub fn kind(&self) -> &'static str {
        match self {
            ManifestProblem::Malformed { .. } => "malformed",
            ManifestProblem::StageRange { .. } => "stage_range",
            ManifestProblem::ModelLayers { .. } => "model_layers",
            ManifestProblem::Missing { .. } => "missing",
            ManifestProblem::ItemSize { .. } => "item_size",
            ManifestProblem::Shape { what, .. } => what,
            ManifestProblem::Unexpected { .. } => "unexpected",
            ManifestProblem::NoLayerIds { .. } => "no_layer_ids",
            ManifestProblem::OutsideStage { .. } => "outside_stage",
        }
    }

    /// The problems' messages joined by `; `.
    pub fn join(problems: &[ManifestProblem]) -> String {
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Notes after a message: ` (a; b)`, or nothing.
fn notes_text(notes: &[String]) -> String {
    if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    }
}

fn tokens_or_none(value: Option<u64>) -> String {
    value.map_or_else(|| "none".to_owned(), |v| v.to_string())
}

/// Sorted layer ids written as ranges: consecutive ids as `a-b`, an arithmetic progression of
/// at least three as `a-b step s`, any other id alone (`3-91 step 4, 92`).
pub fn layer_ranges(layers: &[i64]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let a = layers[i];
        let Some(&next) = layers.get(i + 1) else {
            out.push(a.to_string());
            break;
        };
        let step = next - a;
        let mut j = i + 1;
        while j + 1 < layers.len() && layers[j + 1] - layers[j] == step {
            j += 1;
        }
        let count = j - i + 1;
        if step == 1 {
            out.push(format!("{a}-{}", layers[j]));
        } else if count >= 3 {
            out.push(format!("{a}-{} step {step}", layers[j]));
        } else {
            out.push(a.to_string());
            j = i;
        }
        i = j + 1;
    }
    out.join(", ")
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
        /// Which value differs (for example head_dim).
        what: &'static str,
        /// The prefill value.
        src: String,
        /// The decode value.
        dst: String,
    },
    /// Heads cannot be split evenly over a side's ranks, or a rank is outside its TP size.
    #[error("{what}")]
    Split {
        /// Which heads, ranks and TP size do not fit.
        what: String,
    },
    /// A side publishes heads per rank that do not follow from kv_heads and its TP size.
    #[error(
        "{} publishes heads_per_rank {published} but kv_heads {kv_heads} over TP size {tp} gives {want} per rank",
        side.pick("prefill", "decode")
    )]
    HeadsPerRank {
        /// The side that publishes the value.
        side: Side,
        /// The heads per rank it publishes.
        published: u32,
        /// The model's KV heads.
        kv_heads: u32,
        /// That side's TP size.
        tp: u32,
        /// The heads per rank kv_heads and the TP size give.
        want: u32,
    },
    /// Whole items move but their lengths differ.
    #[error(
        "item lengths differ (prefill {src_item}, decode {dst_item} bytes) although both ranks hold the same heads"
    )]
    ItemsDiffer {
        /// The prefill item size in bytes.
        src_item: u64,
        /// The decode item size in bytes.
        dst_item: u64,
    },
    /// Part of an item moves, and one side's item is not what its geometry implies.
    #[error(
        "a head-sliced transfer needs {} items of page_size {page_size} × {heads} heads × head_dim {head_dim} × {dtype_size} bytes = {want} bytes, this entry has {have}",
        side.pick("prefill", "decode")
    )]
    SlicedItem {
        /// The side whose item is wrong.
        side: Side,
        /// Tokens per page on that side.
        page_size: u64,
        /// KV heads per rank on that side.
        heads: u32,
        /// The head dimension.
        head_dim: u32,
        /// Bytes per element.
        dtype_size: u32,
        /// The item size these give, in bytes.
        want: u64,
        /// The entry's item size in bytes.
        have: u64,
    },
    /// The two sides' TP channel splits of a state pair cannot be bridged.
    #[error(
        "state channel splits differ in {what} (prefill {src}, decode {dst}); a state slot is re-sliced only between splits of the same channels, rows and bytes per channel"
    )]
    StateSplit {
        /// What differs (for example "outer rows").
        what: &'static str,
        /// The prefill value.
        src: String,
        /// The decode value.
        dst: String,
    },
    /// State items neither equal (replicated) nor in the TP ratio (sharded).
    #[error(
        "state item lengths prefill {src_item} bytes at TP {tp_p}, decode {dst_item} bytes at TP {tp_d}: neither equal (a replicated state) nor in the TP ratio ({src_item} × {tp_p} = {dst_item} × {tp_d} for a state sharded over TP)"
    )]
    StateRatio {
        /// The prefill state item size in bytes.
        src_item: u64,
        /// The prefill TP size.
        tp_p: u64,
        /// The decode state item size in bytes.
        dst_item: u64,
        /// The decode TP size.
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
            PlanError::Unsupported { .. } => "unsupported",
            PlanError::InvalidCost { .. } => "cost",
            PlanError::StagingTooSmall { .. } => "staging_too_small",
            PlanError::StagingSlotSizes { .. } => "staging_slots",
            PlanError::BuffersOverlap { .. } => "buffer_overlap",
            PlanError::RequestsOverlap { .. } => "requests_overlap",
            PlanError::SkipTokens { .. } => "skip_tokens",
            PlanError::MissingPartner { .. } => "missing_partner",
            PlanError::FlatBatch { .. } => "flat_batch",
            PlanError::FailedBlocks { .. } => "failed_blocks",
            PlanError::WindowMismatch { .. } => "window",
            PlanError::Conversion { .. } => "conversion",
            PlanError::Manifest { .. } => "manifest",
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
pub(crate) fn try_vec<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
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
            | PlanError::LegacySlice { .. }
            | PlanError::Conversion { .. } => ErrorClass::Pairing,
            PlanError::NegativeIndex { .. }
            | PlanError::IndexOutOfRange { .. }
            | PlanError::DuplicateDestination { .. }
            | PlanError::RequestsOverlap { .. }
            | PlanError::InputChanged
            | PlanError::BlockOutsideBuffers { .. }
            | PlanError::FailedBlocks { .. }
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
            | PlanError::InvalidLayout { .. }
            | PlanError::Manifest { .. } => ErrorClass::Layout,
            PlanError::OutOfMemory { .. } => ErrorClass::Memory,
            PlanError::LengthMismatch { .. }
            | PlanError::FlatBatch { .. }
            | PlanError::Overflow { .. }
            | PlanError::OutputTooSmall { .. }
            | PlanError::Geometry { .. }
            | PlanError::FragmentCombination { .. }
            | PlanError::TokenCount { .. }
            | PlanError::SkipTokens { .. }
            | PlanError::Unsupported { .. }
            | PlanError::DigestInput { .. }
            | PlanError::InvalidCost { .. }
            | PlanError::BuffersOverlap { .. }
            | PlanError::Wire { .. } => ErrorClass::Other,
        }
    }
}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, PlanError>;
