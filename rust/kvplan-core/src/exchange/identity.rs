//! Address-free identity of a layout: a canonical encoding of its geometry plus the caller's
//! model semantics, and the compact class and layout ids hashed from it.
//!
//! The encoding (version 1, spelled out in `docs/identity.md` so another implementation can
//! compute the same ids) holds what decides how a page's or a slot's bytes are to be read:
//! the context's page size and model layer count, the TP, PP and DCP sizes and the DCP
//! interleave, the attention geometry (heads, head size, element size, memory order), every
//! pool's page size and tokens per row, and per entry its kind, pool, window or ring, layer id,
//! role, draft-ness, item length, stride and representation, followed by the semantics (model
//! id, revision, RoPE configuration, draft models, transfer mode, cross-layer flag). An entry's
//! fields but its layer id (its **shape**) are written once per distinct shape, in the order
//! they first appear, and each entry as its shape's index and its layer id, so a model's layers
//! cost two or three bytes each and the hash stays within its time budget.
//!
//! It leaves out what differs between processes that read the same bytes the same way: buffer
//! addresses, buffer lengths (how many pages fit depends on free memory) and the device. The
//! **class id** leaves out the rank coordinates too (TP rank, PP rank, DCP rank), so every rank
//! of one deployment carries the same class id: the value a router matches peers on and a
//! metric exports. The **layout id** adds them, since two TP ranks hold different heads in the
//! same geometry: the value an offload store keys blocks by.

use crate::error::{PlanError, Result};
use crate::peer::entry::{Entry, EntryKind};
use crate::peer::layout::{Layout, MemoryOrder};

/// The encoding's version byte; a change to the encoding changes it and both id prefixes.
pub const IDENTITY_VERSION: u8 = 1;
/// The class id's prefix (rank coordinates left out).
pub const CLASS_ID_PREFIX: &str = "kvc1-";
/// The layout id's prefix (rank coordinates included).
pub const LAYOUT_ID_PREFIX: &str = "kvl1-";
/// The encoding's first bytes.
const MAGIC: &[u8; 5] = b"KVID\x01";

/// Who starts a transfer: the prefill writes into the decode (`Push`) or the decode reads from
/// the prefill (`Pull`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferMode {
    /// The prefill writes.
    Push,
    /// The decode reads.
    Pull,
}

impl TransferMode {
    /// `"push"` or `"pull"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::Push => "push",
            TransferMode::Pull => "pull",
        }
    }

    /// Parses [`TransferMode::as_str`] output.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] naming the value for any other string.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "push" => Ok(TransferMode::Push),
            "pull" => Ok(TransferMode::Pull),
            other => Err(PlanError::InvalidLayout {
                what: format!(
                    "model semantics: unknown transfer mode {other:?}; expected \"push\" or \"pull\""
                ),
            }),
        }
    }
}

/// What the caller says about the model a layout serves, beyond its geometry: what makes two
/// geometrically equal caches hold different values.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Semantics {
    /// Model id (`""`: not declared).
    pub model: String,
    /// Model revision (`""`: not declared).
    pub revision: String,
    /// RoPE configuration as canonical text (`""`: not declared).
    pub rope: String,
    /// Draft models of speculative decoding, sorted, each once.
    pub drafts: Vec<String>,
    /// Who starts the transfer.
    pub transfer: TransferMode,
    /// Whether the engine keeps cross-layer KV blocks.
    pub cross_layer: bool,
}

impl Default for Semantics {
    fn default() -> Self {
        Self {
            model: String::new(),
            revision: String::new(),
            rope: String::new(),
            drafts: Vec::new(),
            transfer: TransferMode::Push,
            cross_layer: false,
        }
    }
}

impl Semantics {
    /// Semantics with `drafts` sorted and each named once, so the order a caller lists them in
    /// never changes an id.
    pub fn new(
        model: String,
        revision: String,
        rope: String,
        mut drafts: Vec<String>,
        transfer: TransferMode,
        cross_layer: bool,
    ) -> Self {
        drafts.sort();
        drafts.dedup();
        Self {
            model,
            revision,
            rope,
            drafts,
            transfer,
            cross_layer,
        }
    }

    /// The first field that differs from `other`, as `(field, this value, other value)`.
    pub fn first_difference(&self, other: &Semantics) -> Option<(&'static str, String, String)> {
        let text = |s: &str| format!("{s:?}");
        if self.model != other.model {
            return Some(("model id", text(&self.model), text(&other.model)));
        }
        if self.revision != other.revision {
            return Some(("revision", text(&self.revision), text(&other.revision)));
        }
        if self.rope != other.rope {
            return Some(("RoPE configuration", text(&self.rope), text(&other.rope)));
        }
        if self.drafts != other.drafts {
            let list = |d: &[String]| format!("{d:?}");
            return Some(("draft models", list(&self.drafts), list(&other.drafts)));
        }
        if self.transfer != other.transfer {
            return Some((
                "transfer mode",
                self.transfer.as_str().to_owned(),
                other.transfer.as_str().to_owned(),
            ));
        }
        if self.cross_layer != other.cross_layer {
            return Some((
                "cross-layer flag",
                self.cross_layer.to_string(),
                other.cross_layer.to_string(),
            ));
        }
        None
    }
}

/// A layout's identity: the digests of its canonical encoding (with and without the rank
/// coordinates) and the semantics they were computed with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutIdentity {
    semantics: Semantics,
    class_digest: [u8; 32],
    layout_digest: [u8; 32],
}

impl LayoutIdentity {
    /// The identity of `layout` serving a model with `semantics`.
    pub fn new(layout: &Layout, semantics: Semantics) -> Self {
        let encoding = class_encoding(layout, &semantics);
        let class_digest = sha256(&encoding);
        let layout_digest = sha256(&rank_encoding(&class_digest, layout));
        Self {
            semantics,
            class_digest,
            layout_digest,
        }
    }

    /// `kvc1-` and the base32 of the class encoding's SHA-256: the same on every rank of a
    /// deployment (57 printable characters).
    pub fn class_id(&self) -> String {
        format!("{CLASS_ID_PREFIX}{}", base32(&self.class_digest))
    }

    /// `kvl1-` and the base32 of the SHA-256 of the class digest and the rank coordinates: one
    /// rank's exact layout (57 printable characters).
    pub fn layout_id(&self) -> String {
        format!("{LAYOUT_ID_PREFIX}{}", base32(&self.layout_digest))
    }

    /// The SHA-256 of the class encoding.
    pub fn class_digest(&self) -> [u8; 32] {
        self.class_digest
    }

    /// The semantics it was computed from.
    pub fn semantics(&self) -> &Semantics {
        &self.semantics
    }
}

/// The class encoding of `layout` with `semantics` (module docs; `docs/identity.md`).
pub fn class_encoding(layout: &Layout, semantics: &Semantics) -> Vec<u8> {
    let context = layout.context();
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(MAGIC);
    uvarint(&mut out, context.page_size);
    option(&mut out, context.num_model_layers);
    uvarint(&mut out, u64::from(context.tp_size));
    uvarint(&mut out, u64::from(context.pp_size));
    uvarint(&mut out, u64::from(context.dcp.size));
    uvarint(&mut out, context.dcp.interleave);
    match context.attention {
        None => out.push(0),
        Some(a) => {
            out.push(1);
            uvarint(&mut out, u64::from(a.total_kv_heads));
            uvarint(&mut out, u64::from(a.heads_per_rank));
            uvarint(&mut out, u64::from(a.head_dim));
            uvarint(&mut out, u64::from(a.dtype_size));
            out.push(match a.memory_order {
                MemoryOrder::Nhd => 0,
                MemoryOrder::Hnd => 1,
            });
        }
    }
    uvarint(&mut out, layout.pools().len() as u64);
    for pool in layout.pools() {
        uvarint(&mut out, pool.page_size);
        uvarint(&mut out, pool.tokens_per_row);
    }
    let entries = layout.entries();
    let mut shapes: Vec<&Entry> = Vec::new();
    let mut indices: Vec<usize> = Vec::with_capacity(entries.len());
    for entry in entries {
        let index = shapes
            .iter()
            .position(|shape| same_shape(shape, entry))
            .unwrap_or_else(|| {
                shapes.push(entry);
                shapes.len() - 1
            });
        indices.push(index);
    }
    uvarint(&mut out, shapes.len() as u64);
    for shape in &shapes {
        shape_encoding(&mut out, shape);
    }
    uvarint(&mut out, entries.len() as u64);
    for (entry, index) in entries.iter().zip(indices) {
        uvarint(&mut out, index as u64);
        match entry.layer {
            None => out.push(0),
            Some(id) => uvarint(&mut out, zigzag(id) + 1),
        }
    }
    text(&mut out, &semantics.model);
    text(&mut out, &semantics.revision);
    text(&mut out, &semantics.rope);
    uvarint(&mut out, semantics.drafts.len() as u64);
    for draft in &semantics.drafts {
        text(&mut out, draft);
    }
    out.push(match semantics.transfer {
        TransferMode::Push => 0,
        TransferMode::Pull => 1,
    });
    out.push(u8::from(semantics.cross_layer));
    out
}

/// Whether two entries have one shape: every encoded field but the layer id equal.
fn same_shape(a: &Entry, b: &Entry) -> bool {
    a.kind == b.kind
        && a.role == b.role
        && a.draft == b.draft
        && a.item_len == b.item_len
        && a.stride == b.stride
        && a.format == b.format
}

/// One entry's shape: kind with its pool and window or its ring, role, draft-ness, item length,
/// stride, representation.
fn shape_encoding(out: &mut Vec<u8>, entry: &Entry) {
    match entry.kind {
        EntryKind::Page { pool, window } => {
            out.push(0);
            uvarint(out, u64::from(pool.0));
            option(out, window);
        }
        EntryKind::State {
            ring,
            channels: None,
        } => {
            out.push(1);
            option(out, ring);
        }
        // A TP channel split is part of the shape: its own kind byte, so that the encoding of
        // a state entry without one is unchanged.
        EntryKind::State {
            ring,
            channels: Some(split),
        } => {
            out.push(2);
            option(out, ring);
            uvarint(out, split.channels);
            uvarint(out, split.outer_rows);
            uvarint(out, split.groups().len() as u64);
            split.groups().iter().for_each(|&g| uvarint(out, g));
        }
    }
    text(out, &entry.role);
    out.push(u8::from(entry.draft));
    uvarint(out, entry.item_len);
    uvarint(out, entry.stride);
    match entry.format {
        None => out.push(0),
        Some(format) => text(out, &format.text()),
    }
}

/// What the layout id hashes: the class digest, then the TP, PP and DCP ranks.
fn rank_encoding(class_digest: &[u8; 32], layout: &Layout) -> Vec<u8> {
    let context = layout.context();
    let mut out = Vec::with_capacity(48);
    out.extend_from_slice(class_digest);
    uvarint(&mut out, u64::from(context.tp_rank));
    uvarint(&mut out, u64::from(context.pp_rank));
    uvarint(&mut out, u64::from(context.dcp.rank));
    out
}

/// Unsigned LEB128: seven bits a byte, low bits first, the high bit set on every byte but the
/// last.
fn uvarint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// `None` as 0, `Some(v)` as `v + 1` (saturating: no layout holds a window or ring of
/// `u64::MAX`).
fn option(out: &mut Vec<u8>, value: Option<u64>) {
    uvarint(out, value.map_or(0, |v| v.saturating_add(1)));
}

/// A signed value as unsigned: 0, -1, 1, -2, … → 0, 1, 2, 3, ….
fn zigzag(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

/// A string as its UTF-8 byte length and bytes.
fn text(out: &mut Vec<u8>, value: &str) {
    uvarint(out, value.len() as u64);
    out.extend_from_slice(value.as_bytes());
}

/// RFC 4648 base32, lowercase, without padding.
pub fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::with_capacity(bytes.len().div_ceil(5) * 8);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &byte in bytes {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
        buffer &= (1 << bits) - 1;
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

/// SHA-256 (FIPS 180-4) of `data`.
// The constants, initial state and working variables are written as FIPS 180-4 names them.
#[allow(clippy::unreadable_literal, clippy::many_single_char_names)]
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let bit_len = (data.len() as u64).wrapping_mul(8);
    let mut tail = Vec::with_capacity(128);
    let whole = data.len() - data.len() % 64;
    tail.extend_from_slice(&data[whole..]);
    tail.push(0x80);
    while tail.len() % 64 != 56 {
        tail.push(0);
    }
    tail.extend_from_slice(&bit_len.to_be_bytes());
    for block in data[..whole].chunks_exact(64).chain(tail.chunks_exact(64)) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (state, value) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *state = state.wrapping_add(value);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        use std::fmt::Write;
        bytes.iter().fold(String::new(), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
    }

    #[test]
    fn sha256_matches_the_fips_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            hex(&sha256(&[b'a'; 1000])),
            "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3"
        );
    }

    #[test]
    fn base32_matches_rfc_4648() {
        assert_eq!(base32(b""), "");
        assert_eq!(base32(b"f"), "my");
        assert_eq!(base32(b"foobar"), "mzxw6ytboi");
    }

    #[test]
    fn varints_and_zigzag() {
        let mut out = Vec::new();
        uvarint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        assert_eq!(
            [0, -1, 1, -2].map(zigzag),
            [0, 1, 2, 3],
            "zigzag of 0, -1, 1, -2"
        );
    }
}
