//! Conversion plans: a transfer between two layouts whose paired entries hold different KV
//! representations (bf16 prefill → fp8 decode with per-token scales, ...).
//!
//! A conversion plan has the stages of a staged plan with a convert stage between the gather
//! and the network; the conversion runs on the prefill, so the network carries the decode's
//! representation (fp8 values and their scales) and the decode runs nothing:
//! - `gather`: the request's direct blocks from prefill memory into the *gathered* area of the
//!   prefill staging region, back to back in plan order;
//! - `rows`: one convert row per converted piece of the gathered area (a kernel's work list):
//!   its input address and element count and dtype, its output address (in the *converted*
//!   area) and dtype, and its scales: elements per scale, their format ([`ScaleFormat`] code:
//!   0 float32 for `per_token` / `per_token_head`, 1 E8M0 for `mx`, one byte per block of
//!   [`MX_BLOCK`] elements), the address its first scale is written to (in the *scale* area),
//!   and the decode address those scales go to;
//! - `network`: converted rows to their decode pages, scales to the decode's scale entries,
//!   pairs kept as they are (same representation on both sides) straight from the gathered
//!   area; blocks merged when they continue on both sides;
//! - `scatter`: empty (the decode has nothing to do: the network writes its pages).
//!
//! The staging region holds the three areas back to back from its start: gathered
//! (`gathered_bytes`), converted (`converted_bytes`), scales (`scale_bytes`).
//!
//! How it is derived: the decode layout is *widened* into the prefill's representation (every
//! converted entry's sizes × `in size / out size`, every address's distance from the lowest
//! buffer × 2 so the widened buffers stay disjoint, the scale entries the conversion fills left
//! out), the ordinary [`Template`] pairs the prefill with it and checks every rule of a
//! same-representation transfer, and each block of its direct plan maps back to its real
//! decode address (`base + (v − vbase) / factor`, `vbase` the entry's virtual address). So every converted byte lands where a decode in the prefill's representation
//! would have held it, rescaled.
//!
//! What converts (anything else is refused at build with [`PlanError::Conversion`] naming both
//! representations): a `bf16` or `fp16` prefill entry into an `fp8_e4m3`, `fp8_e5m2` or
//! `int8` decode entry with `per_token` or `per_token_head` scales, or into an `fp8_e4m3`
//! entry with `mx` block scales (MXFP8), token-major items, where each decode scale group is
//! held whole by one prefill rank (`per_token` with fewer heads per prefill rank than per
//! decode rank is refused: no prefill rank sees a decode token's heads; `mx` between sides
//! holding different heads per rank is refused unless each rank's slice of a token is whole
//! blocks of [`MX_BLOCK`] elements, in both directions). The quantization rules are stated in
//! docs/api.md ("Conversion plans").
//!
//! The reverse, quantized values with per-token or `mx` scales into `bf16` or `fp16`, is
//! converted on the decode ([`ConversionTemplate::side`] is [`Side::Dst`]): the *prefill* is widened
//! instead, the gather collects the quantized values and then each row's scales from the
//! prefill's scale entries, one network block moves both into the decode staging region, and
//! the decode's convert rows write its pages (kept pairs are scattered).

use crate::error::{PlanError, Result, Side};
use crate::model::plan::Plan;
use crate::model::request::Request;
use crate::model::runs::PageIndex;
use crate::peer::entry::{Entry, EntryKind, Indexing, PoolId};
use crate::peer::kv_format::{KvDtype, MX_BLOCK, Representation, ScaleFormat, ScaleLayout};
use crate::peer::layout::{Layout, MemoryOrder, is_mha_role};
use crate::peer_pair::template::Template;
use crate::planners::pack::{PackBuffer, PlanBuilder};
use crate::rules::check::{TemplateOptions, check_pairs};

/// A conversion plan's kernel work list: one row per converted piece, columns of equal length.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConvertRows {
    /// Address of the row's input (in the gathered area).
    pub in_addrs: Vec<u64>,
    /// Address of the row's output (in the converted area).
    pub out_addrs: Vec<u64>,
    /// Elements of the row.
    pub n_elems: Vec<u64>,
    /// Input dtype code ([`KvDtype::code`]).
    pub in_dtypes: Vec<u8>,
    /// Output dtype code.
    pub out_dtypes: Vec<u8>,
    /// Consecutive elements sharing one scale (a token's heads, one head of a token, or an
    /// `mx` block of [`MX_BLOCK`] elements).
    pub group_elems: Vec<u64>,
    /// How the row's scales are stored ([`ScaleFormat::code`]: 0 float32, 1 E8M0), which
    /// also selects the rule that computes them (docs/api.md, "Conversion plans").
    pub scale_formats: Vec<u8>,
    /// Address the row's first scale is written to (in the scale area); the row has
    /// `n_elems / group_elems` scales there, back to back, each of its format's size.
    pub scale_addrs: Vec<u64>,
    /// Decode address of the row's first scale (its scale entry): where the network moves
    /// those scales.
    pub scale_dst_addrs: Vec<u64>,
}

impl ConvertRows {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.n_elems.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.n_elems.is_empty()
    }
}

/// A request's conversion plan (see the [`crate::planners::convert`] module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversionPlan {
    /// Prefill memory → gathered area (run by the prefill).
    pub gather: Plan,
    /// Gathered area → converted and scale areas (run by the prefill).
    pub rows: ConvertRows,
    /// Staging region → decode pages and scale entries (moved by the engine).
    pub network: Plan,
    /// Decode-side copies after the network (none: the conversion runs on the prefill).
    pub scatter: Plan,
    /// Bytes of the gathered area (the direct plan's bytes, in the prefill representation).
    pub gathered_bytes: u64,
    /// Bytes of the converted area.
    pub converted_bytes: u64,
    /// Bytes of the scale area.
    pub scale_bytes: u64,
    /// Bytes of the (prefill) staging region the plan uses from its start.
    pub staging_bytes: u64,
    /// Bytes of the decode staging region the plan uses from its start (0 when the prefill
    /// converts: the network writes the decode's pages).
    pub dst_staging_bytes: u64,
    /// Which side runs the convert rows.
    pub convert_on: Side,
    /// Blocks of the request's direct plan in the prefill representation.
    pub direct_blocks: usize,
}

/// What happens to the blocks that land in one entry of the widened decode layout.
#[derive(Debug, Clone, Copy)]
struct Target {
    /// Real address of the entry's buffer, and its widened (virtual) one.
    base: u64,
    vbase: u64,
    /// Widened bytes per real byte (1 for an entry kept as it is).
    factor: u64,
    /// How its blocks are converted, `None` for a kept entry.
    conv: Option<Conv>,
}

/// The conversion of one decode entry.
#[derive(Debug, Clone, Copy)]
struct Conv {
    in_dtype: KvDtype,
    out_dtype: KvDtype,
    /// Widened bytes of one scale group, and its elements.
    group_bytes: u64,
    group_elems: u64,
    /// How its scales are stored (and so their size).
    scale_format: ScaleFormat,
    /// Widened item length and stride of the entry.
    item_len: u64,
    stride: u64,
    /// The scale entry: its base address and stride (per page).
    scale_base: u64,
    scale_stride: u64,
}

/// A template for conversion plans between a prefill and a decode layout whose entries may
/// hold different KV representations (see the [`crate::planners::convert`] module).
#[derive(Debug, Clone)]
pub struct ConversionTemplate {
    /// Prefill ↔ widened decode.
    inner: Template,
    /// Per widened decode entry, where its blocks go.
    targets: Vec<Target>,
    /// Widened entries by virtual start: `(vstart, vend, widened entry)`, sorted.
    by_vbase: Vec<(u64, u64, usize)>,
    /// Whether any pair converts (else every plan is the direct plan, moved through staging).
    converts: bool,
    /// Which side runs the convert rows: the prefill (quantizing: `targets` are widened
    /// decode entries) or the decode (dequantizing: `targets` are widened prefill entries).
    side: Side,
}

/// The representation of an entry as text for messages (`unpublished` when it has none).
fn repr_text(layout: &Layout, entry: usize) -> String {
    layout
        .representation(entry)
        .map_or_else(|| "no representation".into(), |r| r.text())
}

/// Whether `src → dst` is a dequantization the decode runs: quantized values with per-token
/// (or `mx` block) scales into plain bf16 or fp16.
fn dequantizes(src: Representation, dst: Representation) -> bool {
    src.dtype.quantized()
        && src.scales.per_token()
        && !dst.dtype.quantized()
        && dst.scales == ScaleLayout::None
}

/// The widened entries of `layout` by virtual start: `(vstart, vend, widened entry)`, sorted.
fn vbase_index(widened: &Layout) -> Vec<(u64, u64, usize)> {
    let mut by_vbase: Vec<(u64, u64, usize)> = (0..widened.n_entries())
        .map(|w| {
            let start = widened.entry(w).buffer.0;
            (start, start + widened.entry(w).buffer.1, w)
        })
        .collect();
    by_vbase.sort_unstable();
    by_vbase
}

/// Why `src → dst` cannot be converted exactly, or `None` when it can.
fn refusal(src: Representation, dst: Representation) -> Option<String> {
    if src.dtype.quantized() {
        return Some(format!(
            "{} values convert only into bf16 or fp16 (dequantized on the decode, from \
             per_token, per_token_head or mx scales); re-quantizing into another quantized \
             dtype or scale layout (such as mx ↔ per_token) or dropping scales loses \
             information no plan accounts for",
            src.dtype.as_str()
        ));
    }
    if !dst.dtype.quantized() {
        return Some(format!(
            "{} → {} rounds or clips values (the formats differ in range and precision)",
            src.dtype.as_str(),
            dst.dtype.as_str()
        ));
    }
    match dst.scales {
        ScaleLayout::None => Some(format!(
            "{} without scales would clip every value beyond its range; give the decode \
             per_token or per_token_head scales",
            dst.dtype.as_str()
        )),
        ScaleLayout::PerTensor => Some(
            "a per_tensor scale is calibrated by the decode's engine, so a transfer cannot \
             reproduce what its quantizer would store"
                .into(),
        ),
        ScaleLayout::PerToken | ScaleLayout::PerTokenHead | ScaleLayout::Mx => None,
    }
}

/// Why an `mx` pair cannot be split between TP ranks, or `None` when it can: when the two
/// sides hold different KV heads per rank, each rank's slice of a token (the smaller side's
/// heads × `head_dim` elements) must be whole blocks of [`MX_BLOCK`] elements, else a block
/// (one shared scale) would be split between ranks, and no prefill rank sees all of a block it
/// would have to quantize.
fn mx_split_refusal(src: &Layout, dst: &Layout, role: &str) -> Option<String> {
    let (Some(gs), Some(gd)) = (src.context().attention, dst.context().attention) else {
        return None;
    };
    if !is_mha_role(role) || gs.heads_per_rank == gd.heads_per_rank {
        return None;
    }
    let slice = u64::from(gs.heads_per_rank.min(gd.heads_per_rank)) * u64::from(gs.head_dim);
    if slice.is_multiple_of(MX_BLOCK) {
        return None;
    }
    Some(format!(
        "a prefill rank holds {} KV heads per token and a decode rank {} (head_dim {}), so \
         each rank's slice of a token is {slice} elements, not whole mx blocks of {MX_BLOCK}: \
         a block and its shared scale would be split between ranks",
        gs.heads_per_rank, gd.heads_per_rank, gs.head_dim
    ))
}

impl ConversionTemplate {
    /// Pairs `src` (prefill) with `dst` (decode) as [`Template::new`] does, converting every
    /// pair whose published representations differ.
    ///
    /// # Errors
    /// [`PlanError::Conversion`] naming both representations for a pair that cannot be
    /// converted exactly; [`PlanError::Overflow`] for converted buffers that span 2^63 bytes or
    /// more; then
    /// as [`Template::new`] between the prefill and the widened decode layout.
    pub fn new(src: &Layout, dst: &Layout, options: TemplateOptions) -> Result<Self> {
        let checks = check_pairs(src, dst, options);
        let mut factors = vec![1u64; dst.n_entries()];
        let mut converted: Vec<Option<(Representation, Representation)>> =
            vec![None; dst.n_entries()];
        let mut dequantized: Vec<Option<(Representation, Representation)>> =
            vec![None; src.n_entries()];
        for check in &checks {
            let Some(d) = check.dst_entry else { continue };
            let s = check.src_entry;
            if check.kind != Indexing::Page {
                continue;
            }
            let (Some(rs), Some(rd)) = (src.representation(s), dst.representation(d)) else {
                continue;
            };
            if rs == rd {
                continue;
            }
            let label = format!("layer {}, role {}", dst.layer_label(d), dst.role_label(d));
            let refuse = |why: String| PlanError::Conversion {
                src_entry: s,
                dst_entry: d,
                label: label.clone(),
                src: repr_text(src, s),
                dst: repr_text(dst, d),
                why,
            };
            let role = dst.entry(d).role.as_str();
            if (rs.scales == ScaleLayout::Mx || rd.scales == ScaleLayout::Mx)
                && let Some(why) = mx_split_refusal(src, dst, role)
            {
                return Err(refuse(why));
            }
            if dequantizes(rs, rd) {
                dequantized[s] = Some((rs, rd));
                continue;
            }
            if let Some(why) = refusal(rs, rd) {
                return Err(refuse(why));
            }
            for (layout, side) in [(src, "prefill"), (dst, "decode")] {
                if layout
                    .context()
                    .attention
                    .is_some_and(|g| g.memory_order == MemoryOrder::Hnd)
                {
                    return Err(refuse(format!(
                        "the {side}'s items are head-major (HND); converted entries need \
                         token-major (NHD) items, whose scale groups are contiguous"
                    )));
                }
            }
            if rd.scales == ScaleLayout::PerToken
                && is_mha_role(role)
                && let (Some(gs), Some(gd)) = (src.context().attention, dst.context().attention)
                && gs.heads_per_rank < gd.heads_per_rank
            {
                return Err(refuse(format!(
                    "a decode rank holds {} KV heads per token and a prefill rank {}: each \
                     per_token scale spans heads of several prefill ranks, which none of them \
                     can compute; give the decode per_token_head scales",
                    gd.heads_per_rank, gs.heads_per_rank
                )));
            }
            factors[d] = u64::from(rs.dtype.size() / rd.dtype.size());
            converted[d] = Some((rs, rd));
        }
        if let Some(s) = dequantized.iter().position(Option::is_some) {
            if let Some(d) = converted.iter().position(Option::is_some) {
                return Err(PlanError::Conversion {
                    src_entry: s,
                    dst_entry: d,
                    label: dst.role_label(d),
                    src: repr_text(src, s),
                    dst: repr_text(dst, d),
                    why: "one template converts on one side: these layouts would quantize some \
                          pairs on the prefill and dequantize others on the decode"
                        .into(),
                });
            }
            return Self::dequantizing(src, dst, options, &dequantized);
        }
        // Entries of the same representation that this prefill does not send (other PP
        // stages' layers) are widened alike, so the widened layout has one shape per
        // representation (its attention geometry describes all its K and V entries).
        let by_repr: Vec<(Representation, u64)> = converted
            .iter()
            .zip(&factors)
            .filter_map(|(c, &f)| c.map(|(_, rd)| (rd, f)))
            .collect();
        for (factor, entry) in factors.iter_mut().zip(dst.entries()) {
            if let Some(rd) = &entry.format
                && let Some(&(_, f)) = by_repr.iter().find(|(r, _)| r == rd)
            {
                *factor = f;
            }
        }
        // The scale entries the conversion fills: those of converted entries (and of their
        // kind on layers this prefill does not send).
        let mut filled = vec![false; dst.n_entries()];
        for (d, &factor) in factors.iter().enumerate() {
            if factor > 1
                && let Some(scale) = dst.scale_entry(d)
            {
                filled[scale] = true;
            }
        }
        let (widened, kept) = widen(dst, &factors, &filled)?;
        let inner = Template::new(src, &widened, options)?;
        let mut targets = Vec::with_capacity(kept.len());
        for (w, &d) in kept.iter().enumerate() {
            let base = dst.entry(d).buffer.0;
            let conv = match converted[d] {
                None => None,
                Some((rs, rd)) => Some(conversion(dst, &widened, d, w, factors[d], (rs, rd))?),
            };
            targets.push(Target {
                base,
                vbase: widened.entry(w).buffer.0,
                factor: factors[d],
                conv,
            });
        }
        Ok(Self {
            inner,
            targets,
            by_vbase: vbase_index(&widened),
            converts: converted.iter().any(Option::is_some),
            side: Side::Src,
        })
    }

    /// The dequantizing template: the prefill widened into the decode's representation.
    fn dequantizing(
        src: &Layout,
        dst: &Layout,
        options: TemplateOptions,
        dequantized: &[Option<(Representation, Representation)>],
    ) -> Result<Self> {
        let mut factors = vec![1u64; src.n_entries()];
        for (s, pair) in dequantized.iter().enumerate() {
            if let Some((rs, rd)) = pair {
                factors[s] = u64::from(rd.dtype.size() / rs.dtype.size());
            }
        }
        let by_repr: Vec<(Representation, (Representation, u64))> = dequantized
            .iter()
            .zip(&factors)
            .filter_map(|(pair, &f)| pair.map(|(rs, rd)| (rs, (rd, f))))
            .collect();
        let mut pair_of: Vec<Option<(Representation, Representation)>> = dequantized.to_vec();
        for (s, repr) in src.representations().iter().enumerate() {
            if let Some(rs) = repr
                && let Some(&(_, (rd, f))) = by_repr.iter().find(|(r, _)| r == rs)
            {
                factors[s] = f;
                pair_of[s] = Some((*rs, rd));
            }
        }
        let mut filled = vec![false; src.n_entries()];
        for (s, &factor) in factors.iter().enumerate() {
            if factor > 1
                && let Some(scale) = src.scale_entry(s)
            {
                filled[scale] = true;
            }
        }
        let (widened, kept) = widen(src, &factors, &filled)?;
        let inner = Template::new(&widened, dst, options)?;
        let mut targets = Vec::with_capacity(kept.len());
        for (w, &s) in kept.iter().enumerate() {
            let conv = match pair_of[s] {
                None => None,
                Some((rs, rd)) => {
                    let mut conv = conversion(src, &widened, s, w, factors[s], (rs, rs))?;
                    // Widened bytes are in the decode's (output) dtype here.
                    let out_size = u64::from(rd.dtype.size());
                    (conv.in_dtype, conv.out_dtype) = (rs.dtype, rd.dtype);
                    conv.group_elems = conv.group_bytes / out_size;
                    Some(conv)
                }
            };
            targets.push(Target {
                base: src.entry(s).buffer.0,
                vbase: widened.entry(w).buffer.0,
                factor: factors[s],
                conv,
            });
        }
        Ok(Self {
            inner,
            targets,
            by_vbase: vbase_index(&widened),
            converts: pair_of.iter().any(Option::is_some),
            side: Side::Dst,
        })
    }

    /// Which side runs the convert rows: [`Side::Src`] (the prefill quantizes before the
    /// network) or [`Side::Dst`] (the decode dequantizes after it).
    pub fn side(&self) -> Side {
        self.side
    }

    /// The template between the prefill and the widened decode layout (its direct plans move
    /// the prefill's bytes to virtual decode addresses).
    pub fn widened(&self) -> &Template {
        &self.inner
    }

    /// Whether any pair converts.
    pub fn converts(&self) -> bool {
        self.converts
    }

    /// The target of virtual address `v`.
    fn target_of(&self, v: u64) -> Result<&Target> {
        let at = self.by_vbase.partition_point(|&(start, _, _)| start <= v);
        let Some(&(start, end, w)) = at.checked_sub(1).map(|i| &self.by_vbase[i]) else {
            return Err(PlanError::InputChanged);
        };
        if v < start || v >= end.max(start + 1) {
            return Err(PlanError::InputChanged);
        }
        Ok(&self.targets[w])
    }

    /// Plans one request (page or token lists, as [`Template::plan`]) as a conversion plan
    /// through `staging` (registered prefill memory) and, when the decode converts,
    /// `dst_staging` (registered decode memory; ignored otherwise); see the
    /// [`crate::planners::convert`] module.
    ///
    /// # Errors
    /// As [`Template::plan`]; [`PlanError::StagingTooSmall`] for a region smaller than what
    /// the plan places in it; [`PlanError::Geometry`] for a block that is not whole scale
    /// groups (a head split the scale layout does not allow) or a decode-side conversion
    /// without `dst_staging`; [`PlanError::Overflow`].
    pub fn plan<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        staging: PackBuffer,
        dst_staging: Option<PackBuffer>,
    ) -> Result<ConversionPlan> {
        // Conversion widens page and token entries; a hybrid request's state part is not
        // checked against its scale layouts, so it is planned apart (a slot request).
        if let Some((src, dst)) = request.state_slot {
            return Err(PlanError::Unsupported {
                planner: "ConversionTemplate.plan",
                feature: "pages_with_state",
                why: format!(
                    "a conversion plan converts page lists; this request carries state slot \
                     ({src}, {dst}) with its pages: plan the pages here and the slot as a \
                     request of its own (a slot request, through this template)"
                ),
            });
        }
        if self.side == Side::Dst {
            let dst_staging = dst_staging.ok_or_else(|| PlanError::Geometry {
                what: "this conversion dequantizes on the decode, so its plan needs a decode \
                       staging region (dst_staging) the network fills and the decode's convert \
                       rows read"
                    .into(),
            })?;
            return self.plan_dequantizing(request, staging, dst_staging);
        }
        let direct = self.inner.plan(request)?;
        let n = direct.lengths.len();
        // First pass: the areas' sizes, so the region is checked before any output is built.
        let (mut gathered, mut converted_bytes, mut scale_bytes) = (0u64, 0u64, 0u64);
        for k in 0..n {
            let len = direct.lengths[k];
            let target = self.target_of(direct.dst_addrs[k])?;
            gathered += len;
            if let Some(conv) = &target.conv {
                converted_bytes += len / target.factor;
                scale_bytes += len / conv.group_bytes * conv.scale_format.size();
            }
        }
        let staging_bytes = gathered + converted_bytes + scale_bytes;
        staging
            .addr
            .checked_add(staging.size)
            .ok_or(PlanError::Overflow {
                what: "staging region end",
            })?;
        if staging_bytes > staging.size {
            return Err(PlanError::StagingTooSmall {
                region: "prefill",
                need: staging_bytes,
                have: staging.size,
                layout: format!(
                    "a conversion of {gathered} gathered bytes into {converted_bytes} bytes \
                     and {scale_bytes} bytes of scales"
                ),
            });
        }
        let (area_gathered, area_converted, area_scales) = (
            staging.addr,
            staging.addr + gathered,
            staging.addr + gathered + converted_bytes,
        );
        let mut gather = PlanBuilder::default();
        let mut network = PlanBuilder::default();
        let mut scale_network = PlanBuilder::default();
        let mut rows = ConvertRows::default();
        let (mut at_in, mut at_out, mut at_scale) = (0u64, 0u64, 0u64);
        for k in 0..n {
            let (src, v, len) = (direct.src_addrs[k], direct.dst_addrs[k], direct.lengths[k]);
            let target = *self.target_of(v)?;
            gather.push_merged((src, area_gathered + at_in, len))?;
            let off = v - target.vbase;
            let real = target.base + off / target.factor;
            match target.conv {
                None => network.push_merged((area_gathered + at_in, real, len))?,
                Some(conv) => {
                    let out_len = len / target.factor;
                    network.push_merged((area_converted + at_out, real, out_len))?;
                    let mut row_at = 0u64;
                    while row_at < len {
                        let row_off = off + row_at;
                        let (item, within) = (row_off / conv.stride, row_off % conv.stride);
                        let chunk = (len - row_at).min(conv.item_len - within);
                        if !within.is_multiple_of(conv.group_bytes)
                            || !chunk.is_multiple_of(conv.group_bytes)
                        {
                            return Err(PlanError::Geometry {
                                what: format!(
                                    "a block of {chunk} bytes at byte {within} of a decode item \
                                     is not whole scale groups of {} bytes ({} elements); the \
                                     scale layout needs each group held by one prefill rank",
                                    conv.group_bytes, conv.group_elems
                                ),
                            });
                        }
                        let groups = chunk / conv.group_bytes;
                        let one_scale = conv.scale_format.size();
                        let scale_dst = conv.scale_base
                            + item * conv.scale_stride
                            + within / conv.group_bytes * one_scale;
                        let in_size = u64::from(conv.in_dtype.size());
                        rows.in_addrs.push(area_gathered + at_in + row_at);
                        rows.out_addrs
                            .push(area_converted + at_out + row_at / target.factor);
                        rows.n_elems.push(chunk / in_size);
                        rows.in_dtypes.push(conv.in_dtype.code());
                        rows.out_dtypes.push(conv.out_dtype.code());
                        rows.group_elems.push(conv.group_elems);
                        rows.scale_formats.push(conv.scale_format.code());
                        rows.scale_addrs.push(area_scales + at_scale);
                        rows.scale_dst_addrs.push(scale_dst);
                        scale_network.push_merged((
                            area_scales + at_scale,
                            scale_dst,
                            groups * one_scale,
                        ))?;
                        at_scale += groups * one_scale;
                        row_at += chunk;
                    }
                    at_out += out_len;
                }
            }
            at_in += len;
        }
        gather.end_pair();
        network.end_pair();
        let mut network = network.finish(0);
        let scales = scale_network.finish(scale_bytes);
        network.src_addrs.extend(&scales.src_addrs);
        network.dst_addrs.extend(&scales.dst_addrs);
        network.lengths.extend(&scales.lengths);
        network.n_runs = network.lengths.len();
        network.total_bytes = network.lengths.iter().sum();
        network.pair_offsets = vec![0, network.lengths.len()];
        Ok(ConversionPlan {
            gather: gather.finish(gathered),
            rows,
            network,
            scatter: Plan {
                pair_offsets: vec![0],
                ..Plan::default()
            },
            gathered_bytes: gathered,
            converted_bytes,
            scale_bytes,
            staging_bytes,
            dst_staging_bytes: 0,
            convert_on: Side::Src,
            direct_blocks: n,
        })
    }

    /// The plan of a dequantizing template: gather quantized values and their scales on the
    /// prefill, one network block between the staging regions, convert rows on the decode
    /// from its staging region into its pages, kept pairs scattered.
    fn plan_dequantizing<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        staging: PackBuffer,
        dst_staging: PackBuffer,
    ) -> Result<ConversionPlan> {
        let direct = self.inner.plan(request)?;
        let n = direct.lengths.len();
        let mut gather = PlanBuilder::default();
        let mut scatter = PlanBuilder::default();
        let mut scale_gathers: Vec<(u64, u64, u64)> = Vec::new();
        let mut rows = ConvertRows::default();
        let mut scale_offsets: Vec<u64> = Vec::new();
        let mut in_offsets: Vec<u64> = Vec::new();
        let (mut at_values, mut at_scales, mut converted) = (0u64, 0u64, 0u64);
        for k in 0..n {
            let (v, dst, len) = (direct.src_addrs[k], direct.dst_addrs[k], direct.lengths[k]);
            let target = *self.target_of(v)?;
            let off = v - target.vbase;
            let real_len = len / target.factor;
            let real_src = target.base + off / target.factor;
            gather.push_merged((real_src, staging.addr + at_values, real_len))?;
            match target.conv {
                None => scatter.push_merged((dst_staging.addr + at_values, dst, real_len))?,
                Some(conv) => {
                    let out_size = u64::from(conv.out_dtype.size());
                    let mut row_at = 0u64;
                    while row_at < len {
                        let row_off = off + row_at;
                        let (item, within) = (row_off / conv.stride, row_off % conv.stride);
                        let chunk = (len - row_at).min(conv.item_len - within);
                        let gb = conv.group_bytes;
                        let (group_elems, n_scales) =
                            if within.is_multiple_of(gb) && chunk.is_multiple_of(gb) {
                                (conv.group_elems, chunk / gb)
                            } else if within / gb == (within + chunk - 1) / gb {
                                (chunk / out_size, 1)
                            } else {
                                return Err(PlanError::Geometry {
                                    what: format!(
                                        "a block of {chunk} bytes at byte {within} of a prefill \
                                         item spans parts of several scale groups of {gb} bytes"
                                    ),
                                });
                            };
                        let one_scale = conv.scale_format.size();
                        let scale_src =
                            conv.scale_base + item * conv.scale_stride + within / gb * one_scale;
                        scale_gathers.push((scale_src, at_scales, n_scales * one_scale));
                        in_offsets.push(at_values + row_at / target.factor);
                        rows.out_addrs.push(dst + row_at);
                        rows.n_elems.push(chunk / out_size);
                        rows.in_dtypes.push(conv.in_dtype.code());
                        rows.out_dtypes.push(conv.out_dtype.code());
                        rows.group_elems.push(group_elems);
                        rows.scale_formats.push(conv.scale_format.code());
                        scale_offsets.push(at_scales);
                        rows.scale_dst_addrs.push(scale_src);
                        at_scales += n_scales * one_scale;
                        converted += chunk;
                        row_at += chunk;
                    }
                }
            }
            at_values += real_len;
        }
        let need = at_values + at_scales;
        for (region, what, have) in [
            (staging, "prefill", staging.size),
            (dst_staging, "decode", dst_staging.size),
        ] {
            region
                .addr
                .checked_add(region.size)
                .ok_or(PlanError::Overflow {
                    what: "staging region end",
                })?;
            if need > have {
                return Err(PlanError::StagingTooSmall {
                    region: what,
                    need,
                    have,
                    layout: format!("{at_values} bytes of values and {at_scales} bytes of scales"),
                });
            }
        }
        for (src, off, len) in scale_gathers {
            gather.push_merged((src, staging.addr + at_values + off, len))?;
        }
        gather.end_pair();
        scatter.end_pair();
        rows.in_addrs = in_offsets.iter().map(|o| dst_staging.addr + o).collect();
        rows.scale_addrs = scale_offsets
            .iter()
            .map(|o| dst_staging.addr + at_values + o)
            .collect();
        let mut network = PlanBuilder::default();
        if need > 0 {
            network.push_merged((staging.addr, dst_staging.addr, need))?;
        }
        network.end_pair();
        Ok(ConversionPlan {
            gather: gather.finish(need),
            rows,
            network: network.finish(need),
            scatter: scatter.finish(0),
            gathered_bytes: at_values,
            converted_bytes: converted,
            scale_bytes: at_scales,
            staging_bytes: need,
            dst_staging_bytes: need,
            convert_on: Side::Dst,
            direct_blocks: n,
        })
    }
}

/// The conversion of decode entry `d` (widened entry `w`) from `rs` to `rd`.
fn conversion(
    dst: &Layout,
    widened: &Layout,
    d: usize,
    w: usize,
    factor: u64,
    (rs, rd): (Representation, Representation),
) -> Result<Conv> {
    let scale = dst.scale_entry(d).ok_or(PlanError::InputChanged)?;
    let scale_format = rd.scales.scale_format().ok_or(PlanError::InputChanged)?;
    let item_len = widened.entry(w).item_len;
    let token_bytes = item_len / dst.context().page_size;
    // Scale groups per token, read from the scale entry the layout validated against this
    // representation (its item length is page_size × groups × one scale's bytes).
    let groups = dst.entry(scale).item_len / dst.context().page_size / scale_format.size();
    let group_bytes = token_bytes / groups.max(1);
    let in_size = u64::from(rs.dtype.size());
    if groups == 0
        || group_bytes == 0
        || group_bytes * groups != token_bytes
        || !group_bytes.is_multiple_of(in_size)
        || factor == 0
    {
        return Err(PlanError::Conversion {
            src_entry: 0,
            dst_entry: d,
            label: dst.role_label(d),
            src: rs.text(),
            dst: rd.text(),
            why: format!(
                "a token of {token_bytes} bytes does not split into {groups} scale group(s)"
            ),
        });
    }
    Ok(Conv {
        in_dtype: rs.dtype,
        out_dtype: rd.dtype,
        scale_format,
        group_bytes,
        group_elems: group_bytes / in_size,
        item_len,
        stride: widened.entry(w).stride,
        scale_base: dst.entry(scale).buffer.0,
        scale_stride: dst.entry(scale).stride,
    })
}

/// The decode layout in the prefill's representation: entry `d`'s sizes × `factors[d]`, every
/// address's distance from the lowest buffer × 2 (so the widened buffers stay disjoint and map
/// back exactly), the `filled`
/// scale entries left out. Returns it and, per widened entry, its decode entry.
fn widen(dst: &Layout, factors: &[u64], filled: &[bool]) -> Result<(Layout, Vec<usize>)> {
    let entry = |d: usize| dst.entry(d);
    let kept: Vec<usize> = (0..dst.n_entries()).filter(|&d| !filled[d]).collect();
    // Virtual addresses are twice the distance from `low`, the lowest buffer's address rounded
    // down to a multiple of 2^32 (so a virtual address keeps the low 33 bits of twice its real
    // one): buffers anywhere in the address space fit, as long as they span less than 2^63
    // bytes.
    let low = kept.iter().map(|&d| entry(d).buffer.0).min().unwrap_or(0) & !0xFFFF_FFFF;
    let overflow = PlanError::Overflow {
        what: "a widened layout: its buffers span 2^63 bytes or more (conversion plans double \
               the distance between buffers)",
    };
    let mut out = Vec::with_capacity(kept.len());
    for &d in &kept {
        let f = factors[d];
        let e = entry(d);
        let offset = e.buffer.0 - low;
        offset
            .checked_add(e.buffer.1)
            .and_then(|e| e.checked_mul(2))
            .ok_or_else(|| overflow.clone())?;
        // Widened entries index the request's pages: a window keeps its size, not its pool.
        let kind = match e.kind {
            EntryKind::Page { window, .. } => EntryKind::Page {
                pool: PoolId::PAGES,
                window,
            },
            state @ EntryKind::State { .. } => state,
        };
        out.push(Entry {
            buffer: (offset * 2, e.buffer.1 * f),
            item_len: e.item_len * f,
            stride: e.stride * f,
            format: None,
            kind,
            ..e.clone()
        });
    }
    let mut context = dst.context().clone();
    // The attention geometry describes the K and V entries: widened with them.
    if let Some(g) = context.attention.as_mut()
        && let Some(&d) = kept.iter().find(|&&d| is_mha_role(&entry(d).role))
    {
        g.dtype_size *= u32::try_from(factors[d]).unwrap_or(1);
    }
    let layout = Layout::from_entries(out, context, None)?;
    Ok((layout, kept))
}
