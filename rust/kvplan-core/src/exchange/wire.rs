//! Versioned binary encoding of a layout, exchanged by peers during the bootstrap handshake.
//!
//! Format v2 (written by this build), little-endian throughout:
//!
//! ```text
//! magic "KVPL" | version u16 (2) | flags u16 (0) | entry count u32
//! context: page_size u64 | num_model_layers u64 (u64::MAX = unknown)
//!          | pp_rank u32 | pp_size u32 | tp_rank u32 | tp_size u32 | device str | ext
//! entry:   data_ptr u64 | data_len u64 | item_len u64 | stride u64
//!          | kind u8 | entry flags u8 | has_id u8 | layer_id i64 | role str | ext
//! trailer: CRC-32 (IEEE) of every preceding byte
//! str:     length u16 | UTF-8 bytes
//! ext:     count u16 | count × (tag u16 | length u16 | bytes)
//! ```
//!
//! Entry flags: bit 0 marks a draft-model entry; other bits must be 0.
//!
//! Extensions carry fields added after the fixed layout, as `tag u16 | length u16 | bytes`: a
//! reader skips an unknown extension whose tag is below `0x8000` and refuses an unknown one at or
//! above it (a field it must understand to plan correctly). A tag appears at most once in one
//! extension list (the context's, or one entry's); a repeated tag is malformed. Context tag `0x8001`: the attention
//! geometry (`kv_heads u32 | heads_per_rank u32 | head_dim u32 | dtype_size u32 | order u8`,
//! order 0 = NHD, 1 = HND), written when the peer publishes it. Context tag `0x8002`: decode
//! context parallelism (`dcp_size u32 | dcp_rank u32 | dcp_interleave u64`), written when it
//! differs from the default (size 1, rank 0, interleave 1), so a layout without DCP encodes as
//! before; a reader that ignored it would plan tokens the peer does not hold. Context tag
//! `0x8005`: the window entries' own pool (`page_size u64`), written when the window entries
//! have one; a reader that ignored it would index the window pool with the full pages. Entry tags
//! `0x8003` (sliding window, u64 tokens), `0x8004` (ring rows per slot, u64) and `0x8006` (KV
//! representation, u64).
//!
//! Pools of their own ([`Layout::with_pool`]): context tag `0x8007`, the pool table, one record
//! per pool beside the request's pages, ids 1, 2, … in order (`id u8 | page_size u64 |
//! tokens_per_row u64`, 17 bytes each, 1 to 7 records), and entry tag `0x8008`, the entry's pool
//! (`id u8`, 1 to 7), on every page entry outside the request's pages (pool 0, never written).
//! They are written when a layout keeps a pool the window pool tag cannot describe (any pool
//! but one window pool of one-token rows holding exactly the window entries), and then replace
//! `0x8005` (the window pool is a record of the table; a message carrying both is malformed), so
//! every layout without such a pool encodes as before. Both are must-understand: a reader that
//! ignored them would index a pool's entries by the request's pages.
//!
//! Format v1 (still read): no `stride` (it equals `item_len`), no entry flags (draft entries are
//! the ones whose role starts with `draft`, the only way v1 told them apart) and no `ext`.
//!
//! Decoding never trusts a count before checking it against the bytes actually present, so a
//! corrupted or hostile message cannot make it allocate more than a small multiple of its own
//! size. Every decoded layout goes through [`Layout::new`]'s validation.

use crate::error::{PlanError, Result};
use crate::peer::entry::{Indexing, Pool, PoolId};
use crate::peer::layout::{AttentionGeometry, Layout, LayoutContext, LayoutParts, MemoryOrder};
use crate::rules::dcp::DcpContext;

const MAGIC: &[u8; 4] = b"KVPL";
/// The version this build writes (it reads this one and v1).
pub const WIRE_VERSION: u16 = 2;
/// The first version, still read: entries without strides, flags or extensions.
pub const WIRE_VERSION_1: u16 = 1;
/// Extension tags at or above this must be understood by the reader.
pub(crate) const EXT_MUST_UNDERSTAND: u16 = 0x8000;
/// Context extension: the attention geometry (heads, head size, memory order). A reader that
/// ignored it could slice heads wrongly, so it is a must-understand tag.
pub const EXT_ATTENTION: u16 = 0x8001;
/// Context extension: decode context parallelism (how tokens are dealt over the peer's ranks).
/// Must be understood: ignoring it would address tokens the peer does not hold.
pub const EXT_DCP: u16 = 0x8002;
/// Entry extension: the entry's sliding window in tokens (u64). Must be understood: a reader
/// that ignored it would plan a window entry as a full one, reading pages the peer freed.
pub const EXT_WINDOW: u16 = 0x8003;
/// Entry extension: the entry's ring rows per request slot (u64). Must be understood: a
/// reader that ignored it would address one slot where the entry keeps a ring of rows.
pub const EXT_RING: u16 = 0x8004;
/// Context extension: the page size of the window entries' own pool (u64). Must be
/// understood: ignoring it would address window pages with the request's full-attention pages.
pub const EXT_WINDOW_POOL: u16 = 0x8005;
/// Entry extension: the entry's KV representation (u64: dtype code in the low byte, scale
/// layout code in the next, [`crate::peer::kv_format::Representation::to_code`]). Must be understood: a
/// reader that ignored it would copy fp8 bytes into a bf16 pool.
pub const EXT_REPRESENTATION: u16 = 0x8006;
/// Context extension: the pool table, one record per pool beside the request's pages
/// ([`POOL_RECORD_LEN`] bytes: id u8, page size u64, tokens per row u64). Must be understood:
/// ignoring it would index those pools' entries by the request's pages.
pub const EXT_POOLS: u16 = 0x8007;
/// Entry extension: the pool of a page entry outside the request's pages (u8, an id of the
/// pool table). Must be understood, as [`EXT_POOLS`].
pub const EXT_POOL: u16 = 0x8008;
/// Entry extension: the state entry's TP channel split ([`crate::peer::entry::StateChannels`]: channels
/// per rank u64, outer rows u64, then each shard group's channel count u64). Must be
/// understood: a reader that ignored it would move the whole slot where only a slice is this
/// rank pair's.
pub const EXT_STATE_CHANNELS: u16 = 0x8009;
/// Bytes of one pool table record.
pub const POOL_RECORD_LEN: usize = 1 + 8 + 8;
/// Payload of [`EXT_DCP`]: size u32, rank u32, interleave u64.
const DCP_LEN: usize = 4 + 4 + 8;
/// Payload of [`EXT_ATTENTION`]: four u32 counts and the memory order byte.
const ATTENTION_LEN: usize = 4 * 4 + 1;
/// Entry flag bit 0: a draft-model entry.
const DRAFT_FLAG: u8 = 1;
/// Largest entry count accepted (a 61-layer model with every extra buffer has a few hundred).
pub(crate) const MAX_ENTRIES: u32 = 1 << 20;
/// Bytes of the fixed part of one v1 entry (without its role's bytes).
const ENTRY_FIXED: usize = 8 + 8 + 8 + 1 + 1 + 8 + 2;
/// The same in v2: a stride, the entry flags and an (empty) extension list more.
const ENTRY_FIXED_V2: usize = ENTRY_FIXED + 8 + 1 + 2;
const HEADER: usize = 4 + 2 + 2 + 4;
const CONTEXT_FIXED: usize = 8 + 8 + 4 * 4 + 2;
const TRAILER: usize = 4;

fn wire_error(what: impl Into<String>) -> PlanError {
    PlanError::Wire { what: what.into() }
}

/// Encodes a layout (exact round trip with [`decode`]).
///
/// # Errors
/// [`PlanError::Wire`] when a role or the device name exceeds 65,535 bytes.
pub fn encode(layout: &Layout) -> Result<Vec<u8>> {
    let table = pool_table(layout);
    let ctx = layout.context();
    let n = layout.n_entries();
    let strings: usize =
        layout.entries().iter().map(|e| e.role.len()).sum::<usize>() + ctx.device.len();
    let mut out =
        Vec::with_capacity(HEADER + CONTEXT_FIXED + 2 + n * ENTRY_FIXED_V2 + strings + TRAILER);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    let count =
        u32::try_from(n).map_err(|_| wire_error(format!("{n} entries do not fit the format")))?;
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&ctx.page_size.to_le_bytes());
    out.extend_from_slice(&ctx.num_model_layers.unwrap_or(u64::MAX).to_le_bytes());
    for value in [ctx.pp_rank, ctx.pp_size, ctx.tp_rank, ctx.tp_size] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    put_str(&mut out, &ctx.device)?;
    let dcp = (ctx.dcp != DcpContext::default()).then_some(ctx.dcp);
    let pool = layout.window_page_size().filter(|_| table.is_none());
    let count = u16::from(ctx.attention.is_some())
        + u16::from(dcp.is_some())
        + u16::from(pool.is_some())
        + u16::from(table.is_some());
    out.extend_from_slice(&count.to_le_bytes());
    if let Some(geometry) = &ctx.attention {
        out.extend_from_slice(&EXT_ATTENTION.to_le_bytes());
        out.extend_from_slice(&(ATTENTION_LEN as u16).to_le_bytes());
        encode_attention(&mut out, geometry);
    }
    if let Some(dcp) = dcp {
        out.extend_from_slice(&EXT_DCP.to_le_bytes());
        out.extend_from_slice(&(DCP_LEN as u16).to_le_bytes());
        out.extend_from_slice(&dcp.size.to_le_bytes());
        out.extend_from_slice(&dcp.rank.to_le_bytes());
        out.extend_from_slice(&dcp.interleave.to_le_bytes());
    }
    if let Some(page_size) = pool {
        out.extend_from_slice(&EXT_WINDOW_POOL.to_le_bytes());
        out.extend_from_slice(&8u16.to_le_bytes());
        out.extend_from_slice(&page_size.to_le_bytes());
    }
    if let Some(pools) = table {
        out.extend_from_slice(&EXT_POOLS.to_le_bytes());
        // At most 7 records of 17 bytes: the length fits a u16.
        out.extend_from_slice(&((pools.len() * POOL_RECORD_LEN) as u16).to_le_bytes());
        for pool in pools {
            out.push(pool.id.0);
            out.extend_from_slice(&pool.page_size.to_le_bytes());
            out.extend_from_slice(&pool.tokens_per_row.to_le_bytes());
        }
    }
    for e in layout.entries() {
        out.extend_from_slice(&e.buffer.0.to_le_bytes());
        out.extend_from_slice(&e.buffer.1.to_le_bytes());
        out.extend_from_slice(&e.item_len.to_le_bytes());
        out.extend_from_slice(&e.stride.to_le_bytes());
        out.push(match e.indexing() {
            Indexing::Page => 0,
            Indexing::State => 1,
        });
        out.push(if e.draft { DRAFT_FLAG } else { 0 });
        out.push(u8::from(e.layer.is_some()));
        out.extend_from_slice(&e.layer.unwrap_or(0).to_le_bytes());
        put_str(&mut out, &e.role)?;
        let extensions = [
            (EXT_WINDOW, e.window()),
            (EXT_RING, e.ring()),
            (EXT_REPRESENTATION, e.format.map(|r| r.to_code())),
        ];
        let member = e.pool().filter(|p| table.is_some() && *p != PoolId::PAGES);
        let split = e.channels();
        let count = extensions.iter().filter(|(_, v)| v.is_some()).count() as u16
            + u16::from(member.is_some())
            + u16::from(split.is_some());
        out.extend_from_slice(&count.to_le_bytes());
        for (tag, value) in extensions {
            if let Some(value) = value {
                out.extend_from_slice(&tag.to_le_bytes());
                out.extend_from_slice(&8u16.to_le_bytes());
                out.extend_from_slice(&value.to_le_bytes());
            }
        }
        if let Some(pool) = member {
            out.extend_from_slice(&EXT_POOL.to_le_bytes());
            out.extend_from_slice(&1u16.to_le_bytes());
            out.push(pool.0);
        }
        if let Some(split) = split {
            out.extend_from_slice(&EXT_STATE_CHANNELS.to_le_bytes());
            // At most MAX_SHARD_GROUPS + 2 values of 8 bytes: the length fits a u16.
            out.extend_from_slice(&(((split.groups().len() + 2) * 8) as u16).to_le_bytes());
            out.extend_from_slice(&split.channels.to_le_bytes());
            out.extend_from_slice(&split.outer_rows.to_le_bytes());
            for g in split.groups() {
                out.extend_from_slice(&g.to_le_bytes());
            }
        }
    }
    let crc = crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// The pools beside the request's pages, when the window pool tag cannot describe them: the
/// window pool form holds one pool of one-token rows whose members are exactly the window
/// entries (as [`Layout::with_window_pool`] makes it), and anything else needs the table.
fn pool_table(layout: &Layout) -> Option<&[Pool]> {
    let further = &layout.pools()[1..];
    let window_form = match further {
        [] => true,
        [pool] => {
            let entries = layout.entries();
            pool.tokens_per_row == 1
                && entries.iter().any(|e| e.pool() == Some(pool.id))
                && entries
                    .iter()
                    .filter(|e| e.is_page())
                    .all(|e| e.window().is_some() == (e.pool() == Some(pool.id)))
        }
        _ => false,
    };
    (!window_form).then_some(further)
}

/// The records of a pool table extension, ids 1, 2, … in order.
fn decode_pool_table(payload: &[u8]) -> Result<Vec<Pool>> {
    let records = payload.len() / POOL_RECORD_LEN;
    if payload.is_empty()
        || !payload.len().is_multiple_of(POOL_RECORD_LEN)
        || records >= crate::peer::entry::POOLS
    {
        return Err(wire_error(format!(
            "a pool table extension holds {} bytes; it must hold 1 to {} records of \
             {POOL_RECORD_LEN} bytes (id u8, page_size u64, tokens_per_row u64)",
            payload.len(),
            crate::peer::entry::POOLS - 1
        )));
    }
    let word = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&payload[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    payload
        .chunks_exact(POOL_RECORD_LEN)
        .enumerate()
        .map(|(k, record)| {
            let at = k * POOL_RECORD_LEN;
            if usize::from(record[0]) != k + 1 {
                return Err(wire_error(format!(
                    "pool table record {k} has id {}; the ids must run 1, 2, … in order \
                     (expected {})",
                    record[0],
                    k + 1
                )));
            }
            Ok(Pool {
                id: PoolId(record[0]),
                page_size: word(at + 1),
                tokens_per_row: word(at + 9),
            })
        })
        .collect()
}

fn put_str(out: &mut Vec<u8>, text: &str) -> Result<()> {
    let len = u16::try_from(text.len())
        .map_err(|_| wire_error(format!("string of {} bytes exceeds 65535", text.len())))?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    Ok(())
}

/// Decodes [`encode`]'s output (v2) or a v1 message.
///
/// # Errors
/// [`PlanError::Wire`] for a wrong magic, an unknown version, truncation, trailing bytes, a
/// checksum mismatch, bad UTF-8 or an out-of-range field; then [`Layout::new`]'s errors.
pub fn decode(data: &[u8]) -> Result<Layout> {
    if data.len() < HEADER + CONTEXT_FIXED + TRAILER {
        return Err(wire_error(format!(
            "{} bytes is too short for a layout (at least {} needed)",
            data.len(),
            HEADER + CONTEXT_FIXED + TRAILER
        )));
    }
    if &data[..4] != MAGIC {
        return Err(wire_error("not a kvplan layout (bad magic)"));
    }
    let mut reader = Reader {
        data: &data[..data.len() - TRAILER],
        at: 4,
    };
    let version = reader.u16()?;
    if version != WIRE_VERSION && version != WIRE_VERSION_1 {
        return Err(wire_error(format!(
            "unknown layout wire version {version} (this build reads versions {WIRE_VERSION_1} and {WIRE_VERSION})"
        )));
    }
    let v2 = version == WIRE_VERSION;
    let entry_fixed = if v2 { ENTRY_FIXED_V2 } else { ENTRY_FIXED };
    let stored_crc = u32::from_le_bytes(
        data[data.len() - TRAILER..]
            .try_into()
            .map_err(|_| wire_error("truncated"))?,
    );
    let actual_crc = crc32(&data[..data.len() - TRAILER]);
    if stored_crc != actual_crc {
        return Err(wire_error(format!(
            "checksum mismatch (stored {stored_crc:#010x}, computed {actual_crc:#010x}): data corrupted or truncated"
        )));
    }
    let flags = reader.u16()?;
    if flags != 0 {
        return Err(wire_error(format!("unknown flags {flags:#06x}")));
    }
    let count = reader.u32()?;
    if count > MAX_ENTRIES {
        return Err(wire_error(format!(
            "{count} entries exceeds the limit of {MAX_ENTRIES}"
        )));
    }
    let n = count as usize;
    // Check the count against the bytes present before allocating anything sized by it.
    if n.saturating_mul(entry_fixed) > reader.remaining() {
        return Err(wire_error(format!(
            "{n} entries announced but only {} bytes follow",
            reader.remaining()
        )));
    }
    let page_size = reader.u64()?;
    let layers = reader.u64()?;
    let mut context = LayoutContext {
        page_size,
        num_model_layers: (layers != u64::MAX).then_some(layers),
        pp_rank: reader.u32()?,
        pp_size: reader.u32()?,
        tp_rank: reader.u32()?,
        tp_size: reader.u32()?,
        device: reader.string()?,
        attention: None,
        dcp: DcpContext::default(),
    };
    let mut window_pool = None;
    let mut table: Option<Vec<Pool>> = None;
    if v2 {
        reader.extensions("the context", |tag, payload| match tag {
            EXT_ATTENTION => {
                context.attention = Some(decode_attention(payload)?);
                Ok(true)
            }
            EXT_DCP => {
                context.dcp = decode_dcp(payload)?;
                Ok(true)
            }
            EXT_WINDOW_POOL => {
                let bytes: [u8; 8] = payload.try_into().map_err(|_| {
                    wire_error(format!(
                        "a window pool extension holds {} bytes; it must hold 8",
                        payload.len()
                    ))
                })?;
                window_pool = Some(u64::from_le_bytes(bytes));
                Ok(true)
            }
            EXT_POOLS => {
                table = Some(decode_pool_table(payload)?);
                Ok(true)
            }
            _ => Ok(false),
        })?;
    }
    if table.is_some() && window_pool.is_some() {
        return Err(wire_error(format!(
            "the context carries both a window pool ({EXT_WINDOW_POOL:#06x}) and a pool table \
             ({EXT_POOLS:#06x}); the table holds the window pool, so a message has one or the \
             other"
        )));
    }
    let mut members: Vec<PoolId> = Vec::with_capacity(if table.is_some() { n } else { 0 });
    let mut strides = Vec::with_capacity(if v2 { n } else { 0 });
    let mut windows: Vec<Option<u64>> = Vec::with_capacity(if v2 { n } else { 0 });
    let mut representations: Vec<Option<crate::peer::kv_format::Representation>> = Vec::new();
    let mut rings: Vec<Option<u64>> = Vec::with_capacity(if v2 { n } else { 0 });
    let mut splits: Vec<Option<crate::peer::entry::StateChannels>> =
        Vec::with_capacity(if v2 { n } else { 0 });
    let mut parts = LayoutParts {
        data_ptrs: Vec::with_capacity(n),
        data_lens: Vec::with_capacity(n),
        item_lens: Vec::with_capacity(n),
        layer_ids: Vec::with_capacity(n),
        roles: Vec::with_capacity(n),
        kinds: Vec::with_capacity(n),
        // Version 1: left empty, so Layout::new derives draft-ness from the roles.
        drafts: Vec::with_capacity(if v2 { n } else { 0 }),
    };
    for _ in 0..n {
        parts.data_ptrs.push(reader.u64()?);
        parts.data_lens.push(reader.u64()?);
        parts.item_lens.push(reader.u64()?);
        if v2 {
            strides.push(reader.u64()?);
        }
        parts.kinds.push(match reader.u8()? {
            0 => Indexing::Page,
            1 => Indexing::State,
            other => return Err(wire_error(format!("unknown entry kind code {other}"))),
        });
        if v2 {
            let flags = reader.u8()?;
            if flags & !DRAFT_FLAG != 0 {
                return Err(wire_error(format!("unknown entry flags {flags:#04x}")));
            }
            parts.drafts.push(flags & DRAFT_FLAG != 0);
        }
        let has_id = reader.u8()?;
        let id = i64::from_le_bytes(
            reader
                .bytes(8)?
                .try_into()
                .map_err(|_| wire_error("truncated"))?,
        );
        parts.layer_ids.push(match has_id {
            0 => None,
            1 => Some(id),
            other => return Err(wire_error(format!("bad layer-id flag {other}"))),
        });
        parts.roles.push(reader.string()?);
        if v2 {
            let (mut window, mut ring, mut repr, mut member) = (None, None, None, None);
            let mut split = None;
            let entry = windows.len();
            reader.extensions("an entry", |tag, payload| {
                if tag == EXT_POOL {
                    member = Some(decode_member(entry, payload, table.as_deref())?);
                    return Ok(true);
                }
                if tag == EXT_STATE_CHANNELS {
                    split = Some(decode_state_channels(entry, payload)?);
                    return Ok(true);
                }
                let (slot, what) = match tag {
                    EXT_WINDOW => (&mut window, "window"),
                    EXT_RING => (&mut ring, "ring"),
                    EXT_REPRESENTATION => (&mut repr, "representation"),
                    _ => return Ok(false),
                };
                let bytes: [u8; 8] = payload.try_into().map_err(|_| {
                    wire_error(format!(
                        "a {what} extension holds {} bytes; it must hold 8",
                        payload.len()
                    ))
                })?;
                *slot = Some(u64::from_le_bytes(bytes));
                Ok(true)
            })?;
            if table.is_some() {
                members.push(member.unwrap_or(PoolId::PAGES));
            }
            windows.push(window);
            rings.push(ring);
            splits.push(split);
            let entry = representations.len();
            representations.push(
                repr.map(|code| {
                    crate::peer::kv_format::Representation::from_code(code).ok_or_else(|| {
                        wire_error(format!(
                            "entry {entry}: unknown representation code {code:#x}"
                        ))
                    })
                })
                .transpose()?,
            );
        }
    }
    if reader.remaining() != 0 {
        return Err(wire_error(format!(
            "{} unexpected bytes after the last entry",
            reader.remaining()
        )));
    }
    let layout = Layout::new(parts, context)?.with_strides(strides)?;
    match table {
        Some(pools) => layout.with_pool_table(&pools, &members, &windows)?,
        None => layout.with_windows_in_pool(windows, window_pool)?,
    }
    .with_rings(rings)?
    .with_state_channels(if splits.iter().any(Option::is_some) {
        splits
    } else {
        Vec::new()
    })?
    .with_representations(if representations.iter().any(Option::is_some) {
        representations
    } else {
        Vec::new()
    })
}

/// The TP channel split an entry's extension holds: channels, rows, then the shard groups.
fn decode_state_channels(
    entry: usize,
    payload: &[u8],
) -> Result<crate::peer::entry::StateChannels> {
    if !payload.len().is_multiple_of(8) || payload.len() < 16 {
        return Err(wire_error(format!(
            "entry {entry}: a state channel split extension holds {} bytes; it must hold 8 × \
             (2 + shard groups)",
            payload.len()
        )));
    }
    let values: Vec<u64> = payload
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect();
    crate::peer::entry::StateChannels::new(values[0], values[1], &values[2..])
}

/// The pool an entry's pool extension names: one byte, a pool of the table.
fn decode_member(entry: usize, payload: &[u8], table: Option<&[Pool]>) -> Result<PoolId> {
    let Some(table) = table else {
        return Err(wire_error(format!(
            "entry {entry} carries a pool extension ({EXT_POOL:#06x}) but the context carries \
             no pool table ({EXT_POOLS:#06x})"
        )));
    };
    let &[id] = payload else {
        return Err(wire_error(format!(
            "entry {entry}: a pool extension holds {} bytes; it must hold 1 (the pool id)",
            payload.len()
        )));
    };
    if id == 0 || usize::from(id) > table.len() {
        return Err(wire_error(format!(
            "entry {entry}: pool id {id} is not a pool of the table (ids 1 to {}; the \
             request's pages, pool 0, are never written)",
            table.len()
        )));
    }
    Ok(PoolId(id))
}

fn encode_attention(out: &mut Vec<u8>, g: &AttentionGeometry) {
    for value in [g.total_kv_heads, g.heads_per_rank, g.head_dim, g.dtype_size] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.push(match g.memory_order {
        MemoryOrder::Nhd => 0,
        MemoryOrder::Hnd => 1,
    });
}

fn decode_dcp(payload: &[u8]) -> Result<DcpContext> {
    let bytes: [u8; DCP_LEN] = payload.try_into().map_err(|_| {
        wire_error(format!(
            "DCP context of {} bytes (expected {DCP_LEN})",
            payload.len()
        ))
    })?;
    let u32_at =
        |k: usize| u32::from_le_bytes([bytes[k], bytes[k + 1], bytes[k + 2], bytes[k + 3]]);
    let mut interleave = [0u8; 8];
    interleave.copy_from_slice(&bytes[8..]);
    Ok(DcpContext {
        size: u32_at(0),
        rank: u32_at(4),
        interleave: u64::from_le_bytes(interleave),
    })
}

fn decode_attention(payload: &[u8]) -> Result<AttentionGeometry> {
    if payload.len() != ATTENTION_LEN {
        return Err(wire_error(format!(
            "attention geometry of {} bytes (expected {ATTENTION_LEN})",
            payload.len()
        )));
    }
    let word = |k: usize| {
        u32::from_le_bytes([
            payload[4 * k],
            payload[4 * k + 1],
            payload[4 * k + 2],
            payload[4 * k + 3],
        ])
    };
    Ok(AttentionGeometry {
        total_kv_heads: word(0),
        heads_per_rank: word(1),
        head_dim: word(2),
        dtype_size: word(3),
        memory_order: match payload[16] {
            0 => MemoryOrder::Nhd,
            1 => MemoryOrder::Hnd,
            other => return Err(wire_error(format!("unknown memory order code {other}"))),
        },
    })
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.data.len() - self.at
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.remaining() < n {
            return Err(wire_error(format!(
                "truncated at byte {} (needed {n} more, {} left)",
                self.at,
                self.remaining()
            )));
        }
        let slice = &self.data[self.at..self.at + n];
        self.at += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Reads an extension list; `known` handles the tags this build understands (returning
    /// `true`), the others are skipped or refused by their tag. A tag may appear once per list:
    /// a repeated one would make the decoded value depend on which copy wins and the layout
    /// re-encode to different bytes, so it is malformed, known or not.
    fn extensions(
        &mut self,
        owner: &str,
        mut known: impl FnMut(u16, &[u8]) -> Result<bool>,
    ) -> Result<()> {
        let count = self.u16()?;
        // One bit per possible tag (8 KiB), only for a non-empty list: linear in the count.
        let mut seen = if count > 0 {
            vec![0u64; 1 << 10]
        } else {
            Vec::new()
        };
        for _ in 0..count {
            let tag = self.u16()?;
            let (word, bit) = (usize::from(tag >> 6), 1u64 << (tag & 63));
            if seen[word] & bit != 0 {
                return Err(wire_error(format!(
                    "{owner} carries extension {tag:#06x} twice; each extension may appear once"
                )));
            }
            seen[word] |= bit;
            let len = usize::from(self.u16()?);
            let payload = self.bytes(len)?;
            if known(tag, payload)? {
                continue;
            }
            if tag >= EXT_MUST_UNDERSTAND {
                return Err(wire_error(format!(
                    "{owner} carries extension {tag:#06x}, which this build does not know and must understand to plan correctly (upgrade kvplan)"
                )));
            }
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String> {
        let len = usize::from(self.u16()?);
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| wire_error(format!("string at byte {} is not UTF-8", self.at - len)))
    }
}

/// CRC-32 (IEEE 802.3, reflected: the same value as zlib's `crc32`), from `crc32fast`, the
/// implementation the ecosystem shares (table-driven, SIMD where the CPU has it).
pub fn crc32(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_pool_wider_in_tokens_than_at_the_layouts_page_size_decodes() {
        // Entry 1 holds 4 items: a 5-token window fits 4 pool pages of 2 tokens, not 4 pages
        // of the layout's 1 token; decoding checks it at the pool's page size, as building did.
        let pooled = Layout::mla(
            vec![1 << 30, 1 << 31],
            vec![32, 64],
            vec![8, 16],
            Some(vec![0, 1]),
            LayoutContext {
                page_size: 1,
                ..LayoutContext::default()
            },
        )
        .unwrap()
        .with_windows_in_pool(vec![None, Some(5)], Some(2))
        .unwrap();
        assert_eq!(decode(&encode(&pooled).unwrap()).unwrap(), pooled);
    }

    /// The version 1 encoding (no strides, no entry flags, no extensions), as earlier builds
    /// wrote it.
    fn encode_v1(layout: &Layout) -> Vec<u8> {
        let (parts, ctx) = (layout.parts(), layout.context());
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&WIRE_VERSION_1.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(layout.n_entries() as u32).to_le_bytes());
        out.extend_from_slice(&ctx.page_size.to_le_bytes());
        out.extend_from_slice(&ctx.num_model_layers.unwrap_or(u64::MAX).to_le_bytes());
        for value in [ctx.pp_rank, ctx.pp_size, ctx.tp_rank, ctx.tp_size] {
            out.extend_from_slice(&value.to_le_bytes());
        }
        put_str(&mut out, &ctx.device).unwrap();
        for i in 0..layout.n_entries() {
            for value in [parts.data_ptrs[i], parts.data_lens[i], parts.item_lens[i]] {
                out.extend_from_slice(&value.to_le_bytes());
            }
            out.push(u8::from(parts.kinds[i] == Indexing::State));
            out.push(u8::from(parts.layer_ids[i].is_some()));
            out.extend_from_slice(&parts.layer_ids[i].unwrap_or(0).to_le_bytes());
            put_str(&mut out, &parts.roles[i]).unwrap();
        }
        let crc = crc32(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    fn sample() -> Layout {
        let ctx = LayoutContext {
            page_size: 64,
            device: "npu".into(),
            num_model_layers: Some(48),
            pp_rank: 1,
            pp_size: 2,
            tp_rank: 0,
            tp_size: 4,
            attention: None,
            dcp: DcpContext::default(),
        };
        Layout::npu_groups(
            vec![3, 7],
            vec![1, 2, 3, 4],
            vec![64; 4],
            vec![8; 4],
            None,
            ctx,
        )
        .unwrap()
        .with_state("mamba_conv", vec![99], vec![160], vec![16], vec![1])
        .unwrap()
    }

    #[test]
    fn windows_round_trip_as_entry_extensions() {
        let layout = sample();
        let windows: Vec<Option<u64>> = (0..layout.n_entries())
            .map(|i| (layout.parts().kinds[i] == Indexing::Page && i % 2 == 1).then_some(128))
            .collect();
        let windowed = layout.clone().with_windows(windows.clone()).unwrap();
        let bytes = encode(&windowed).unwrap();
        let back = decode(&bytes).unwrap();
        assert_eq!(back.windows(), &windows[..]);
        assert_eq!(back, windowed);
        assert_ne!(bytes, encode(&layout).unwrap());
        assert_eq!(
            decode(&encode(&layout).unwrap()).unwrap().windows(),
            layout.windows()
        );
    }

    #[test]
    fn round_trip_is_exact() {
        let layout = sample();
        assert_eq!(decode(&encode(&layout).unwrap()).unwrap(), layout);
    }

    #[test]
    fn attention_geometry_round_trips_as_a_context_extension() {
        let geometry = AttentionGeometry {
            total_kv_heads: 8,
            heads_per_rank: 2,
            head_dim: 128,
            dtype_size: 2,
            memory_order: MemoryOrder::Hnd,
        };
        let ctx = LayoutContext {
            page_size: 16,
            tp_rank: 1,
            tp_size: 4,
            attention: Some(geometry),
            ..LayoutContext::default()
        };
        let layout = Layout::mha(
            vec![4096],
            vec![1 << 30],
            vec![1 << 20],
            vec![1 << 20],
            vec![8192],
            vec![8192],
            Some(vec![0]),
            ctx,
        )
        .unwrap();
        let bytes = encode(&layout).unwrap();
        assert_eq!(decode(&bytes).unwrap(), layout);
        // A payload of the wrong size is refused, not misread.
        let mut short = bytes[..bytes.len() - TRAILER].to_vec();
        let at = short
            .windows(4)
            .position(|w| w == [0x01, 0x80, ATTENTION_LEN as u8, 0])
            .unwrap();
        short[at + 2] = ATTENTION_LEN as u8 - 1;
        short.remove(at + 4);
        let crc = crc32(&short);
        short.extend_from_slice(&crc.to_le_bytes());
        assert!(
            decode(&short)
                .unwrap_err()
                .to_string()
                .contains("attention geometry")
        );
    }

    #[test]
    fn draft_flag_round_trips_and_version_1_derives_it() {
        // Draft entries of a layout without roles: only the entry flag says they are drafts.
        let parts = LayoutParts {
            data_ptrs: vec![8],
            data_lens: vec![64],
            item_lens: vec![8],
            layer_ids: vec![Some(0)],
            ..Default::default()
        };
        let base = Layout::new(parts, LayoutContext::default()).unwrap();
        let draft = base
            .with_draft(vec![100], vec![64], vec![8], &[0], 1, None)
            .unwrap();
        assert!(draft.is_draft(1) && draft.role(1).is_none());
        assert_eq!(decode(&encode(&draft).unwrap()).unwrap(), draft);
        // Version 1 bytes (no entry flags byte) of a layout with draft roles.
        let named = Layout::mla(
            vec![8],
            vec![64],
            vec![8],
            Some(vec![0]),
            LayoutContext::default(),
        )
        .unwrap()
        .with_draft(vec![100], vec![64], vec![8], &[0], 1, None)
        .unwrap();
        let v1 = encode_v1(&named);
        let decoded = decode(&v1).unwrap();
        assert_eq!(decoded, named);
        assert!(decoded.is_draft(1) && !decoded.is_draft(0));
    }

    /// `bytes` (without trailer) with one more extension appended to the list whose count is at
    /// `count_at`, and a fresh trailer.
    fn with_extension(bytes: &[u8], count_at: usize, ext: &[u8]) -> Vec<u8> {
        let mut out = bytes[..bytes.len() - TRAILER].to_vec();
        let count = u16::from_le_bytes([out[count_at], out[count_at + 1]]);
        out[count_at..count_at + 2].copy_from_slice(&(count + 1).to_le_bytes());
        let mut end = count_at + 2;
        for _ in 0..count {
            let len = usize::from(u16::from_le_bytes([out[end + 2], out[end + 3]]));
            end += 4 + len;
        }
        out.splice(end..end, ext.iter().copied());
        let crc = crc32(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    #[test]
    fn a_repeated_extension_tag_is_malformed() {
        let geometry = |heads: u32| AttentionGeometry {
            total_kv_heads: heads,
            heads_per_rank: heads,
            head_dim: 128,
            dtype_size: 2,
            memory_order: MemoryOrder::Nhd,
        };
        let ctx = LayoutContext {
            attention: Some(geometry(8)),
            ..LayoutContext::default()
        };
        let layout =
            Layout::mla(vec![4096], vec![1 << 20], vec![2048], Some(vec![0]), ctx).unwrap();
        let bytes = encode(&layout).unwrap();
        // The context's extension count follows the device string ("cpu").
        let count_at = HEADER + 8 + 8 + 4 * 4 + 2 + 3;
        let mut second = Vec::new();
        second.extend_from_slice(&EXT_ATTENTION.to_le_bytes());
        second.extend_from_slice(&(ATTENTION_LEN as u16).to_le_bytes());
        encode_attention(&mut second, &geometry(16));
        let err = decode(&with_extension(&bytes, count_at, &second)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "wire data: the context carries extension 0x8001 twice; each extension may appear once"
        );
        // A skippable tag repeated in an entry's list is just as malformed.
        let entry_ext = bytes.len() - TRAILER - 2;
        let skippable = [0x10, 0x00, 0x01, 0x00, 0xAA];
        let once = with_extension(&bytes, entry_ext, &skippable);
        assert_eq!(decode(&once).unwrap(), layout);
        let twice = with_extension(&once, entry_ext, &skippable);
        assert_eq!(
            decode(&twice).unwrap_err().to_string(),
            "wire data: an entry carries extension 0x0010 twice; each extension may appear once"
        );
    }

    #[test]
    fn crc_matches_zlib() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn every_truncation_and_bit_flip_is_an_error() {
        let bytes = encode(&sample()).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "truncation at {cut} accepted"
            );
        }
        for i in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[i] ^= 0x10;
            assert!(decode(&flipped).is_err(), "bit flip at {i} accepted");
        }
    }
}
