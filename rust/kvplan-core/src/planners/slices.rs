//! Layer-wise streaming: one request's plan cut into per-layer-group slices, each a list of
//! block ranges of that one plan (no re-planning, no copy), plus the **seal** (every block no
//! layer group covers) and the expected-work [`WorkManifest`] a decode checks completeness against.
//!
//! [`LayerSlices`] is built once per template from the caller's [`LayerGroups`]: which of the
//! template's emission groups belong to each layer group, and which to the seal. Slices are
//! keyed by global layer id, never by the order hooks fire in. A coalesced emission group that
//! straddles two layer groups is refused (build the template with
//! [`Template::with_layer_groups`] so coalescing stops at the group edges). Cutting a plan
//! ([`LayerSlices::of`]) only reads the template's group offsets for the plan's summary, so it
//! works the same for page, token and state plans, and for a chunk of a chunked prefill (a plan
//! of the chunk's new pages).

use std::collections::BTreeMap;

use crate::error::{PlanError, Result};
use crate::model::layer_groups::{LayerGroups, PeerRanks, SliceKey, StreamFacts};
use crate::model::plan::{PlanSummary, PlanUnit};
use crate::peer_pair::template::Template;
use crate::planners::batch::BatchSummary;

/// One layer group of a template: the layers whose ready signals it waits for, the template's
/// emission groups whose blocks it sends from a page or token plan, and the blocks it sends
/// from a state plan (its layers' per-request state: the layer's forward writes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceSpec {
    /// The layer group's id ([`LayerGroups::group_of`]).
    pub layer_group: u64,
    /// Layer ids of this template's page and state pairs in the group, ascending (empty: the
    /// group covers no entry of this stage, and its slice of every plan is empty).
    pub layers: Vec<i64>,
    /// The template's emission groups in it, in block order.
    pub emission_groups: Vec<usize>,
    /// Blocks of a state plan in it (one block per moving state pair), ascending.
    pub state_blocks: Vec<usize>,
}

/// A template's layer groups, built once (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSlices {
    groups: LayerGroups,
    slices: Vec<SliceSpec>,
    /// Emission groups sent with the seal, in block order.
    seal_emission_groups: Vec<usize>,
    /// Blocks of a state plan sent with the seal (state of layers no group covers or the
    /// caller marked), ascending.
    seal_state_blocks: Vec<usize>,
    /// Layer id → its slice (layers with entries in a slice).
    layer_slice: BTreeMap<i64, usize>,
    /// Layer ids the template knows that wait for no slice (draft, marked, elided, in no group).
    other_layers: Vec<i64>,
    n_layers: u64,
    prefill: PeerRanks,
    decode: PeerRanks,
    n_pairs: usize,
}

/// Blocks and bytes of one slice of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceWork {
    /// The layer group's id ([`WorkManifest::SEAL`] for the seal).
    pub layer_group: u64,
    /// Blocks.
    pub blocks: u64,
    /// Bytes.
    pub bytes: u64,
}

/// One plan cut into slices: per slice (in [`LayerSlices::slices`] order) its block ranges
/// `start..stop` in the plan, merged where they touch, and its work; the same for the seal.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PlanSlices {
    /// Per slice, its block ranges in plan order.
    pub ranges: Vec<Vec<(usize, usize)>>,
    /// Per slice, its blocks and bytes.
    pub work: Vec<SliceWork>,
    /// The seal's block ranges in this plan (a state plan is all seal).
    pub seal_ranges: Vec<(usize, usize)>,
    /// The seal's blocks and bytes in this plan.
    pub seal: SliceWork,
}

impl LayerSlices {
    /// The slices of `template` for `groups`: every layer group listed (every caller set, or
    /// the fixed groups covering the model's layers) with this template's layers and emission
    /// groups in it, the rest in the seal.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] when one emission group holds pairs of two layer groups (or of a
    /// group and the seal), naming the pairs, their layers and their groups, or when a state
    /// pair moves several byte slices of a slot (a TP channel split).
    pub fn new(template: &Template, groups: &LayerGroups) -> Result<Self> {
        // Layer slices give each moving state pair one block of a state plan.
        template.one_block_per_state_pair("layer slices")?;
        let (src, dst) = template.layouts();
        let facts = &StreamFacts::new(src, dst, template.page_pairs(), template.state_pairs());
        let keys: Vec<SliceKey> = facts.page_tags.iter().map(|t| groups.key(t)).collect();
        // Moving state pairs (one block each in a state plan, in order) and their keys;
        // elided ones move nothing and wait for nothing.
        let moving_state: Vec<(i64, SliceKey)> = template
            .state_pairs()
            .iter()
            .zip(&facts.state_tags)
            .filter(|(pair, _)| pair.item_len > 0)
            .map(|(_, tag)| (tag.layer.unwrap_or(-1), groups.key(tag)))
            .collect();
        let n_groups = groups.n_groups(facts.n_layers);
        // Fixed groups of layers past the model's count (an id band the layouts did not
        // announce) still get slices: the list grows to the largest group seen.
        let seen_max = keys
            .iter()
            .chain(moving_state.iter().map(|(_, k)| k))
            .filter_map(|k| match k {
                SliceKey::LayerGroup(g) => Some(*g + 1),
                SliceKey::Seal => None,
            })
            .max()
            .unwrap_or(0);
        let listed = n_groups.max(seen_max);
        let listed = usize::try_from(listed).map_err(|_| PlanError::Overflow {
            what: "layer group count",
        })?;
        if listed > 1 << 20 {
            return Err(PlanError::Geometry {
                what: format!(
                    "layer groups would list {listed} slices; group ids come from layer ids, \
                     which are at most 2^20 here"
                ),
            });
        }
        let mut slices: Vec<SliceSpec> = (0..listed as u64)
            .map(|layer_group| SliceSpec {
                layer_group,
                layers: Vec::new(),
                emission_groups: Vec::new(),
                state_blocks: Vec::new(),
            })
            .collect();
        let mut seal_emission_groups = Vec::new();
        let mut other_layers: Vec<i64> = facts
            .state_tags
            .iter()
            .filter_map(|t| t.layer)
            .filter(|&l| l >= 0)
            .collect();
        for (g, group) in template.blocks().groups().iter().enumerate() {
            let key = keys[group.first_pair];
            if let Some(p) = (group.first_pair..=group.last_pair).find(|&p| keys[p] != key) {
                return Err(straddle(template, &keys, group.first_pair, p));
            }
            match key {
                SliceKey::LayerGroup(id) => slices[id as usize].emission_groups.push(g),
                SliceKey::Seal => seal_emission_groups.push(g),
            }
        }
        let mut layer_slice = BTreeMap::new();
        for (p, (tag, key)) in facts.page_tags.iter().zip(&keys).enumerate() {
            let Some(layer) = tag.layer else { continue };
            match key {
                SliceKey::LayerGroup(id) if template.blocks().pair_groups()[p].is_some() => {
                    slices[*id as usize].layers.push(layer);
                    layer_slice.insert(layer, *id as usize);
                }
                _ => other_layers.push(layer),
            }
        }
        let mut seal_state_blocks = Vec::new();
        for (block, &(layer, key)) in moving_state.iter().enumerate() {
            match key {
                SliceKey::LayerGroup(id) => {
                    slices[id as usize].state_blocks.push(block);
                    slices[id as usize].layers.push(layer);
                    layer_slice.insert(layer, id as usize);
                }
                SliceKey::Seal => seal_state_blocks.push(block),
            }
        }
        for s in &mut slices {
            s.layers.sort_unstable();
            s.layers.dedup();
        }
        other_layers.sort_unstable();
        other_layers.dedup();
        Ok(Self {
            groups: groups.clone(),
            slices,
            seal_emission_groups,
            seal_state_blocks,
            layer_slice,
            other_layers,
            n_layers: facts.n_layers,
            prefill: facts.prefill,
            decode: facts.decode,
            n_pairs: template.page_pairs().len(),
        })
    }

    /// The slices, in layer-group id order (one per listed group, empty ones included).
    pub fn slices(&self) -> &[SliceSpec] {
        &self.slices
    }

    /// Emission groups sent with the seal.
    pub fn seal_emission_groups(&self) -> &[usize] {
        &self.seal_emission_groups
    }

    /// Blocks of a state plan sent with the seal.
    pub fn seal_state_blocks(&self) -> &[usize] {
        &self.seal_state_blocks
    }

    /// Prefill and decode ranks of the template.
    pub fn peers(&self) -> (PeerRanks, PeerRanks) {
        (self.prefill, self.decode)
    }

    /// The slice that waits for layer `layer` (`None`: a layer of the model this template
    /// holds nothing of in any slice — a layer in no caller set or marked for the seal, whose
    /// entries go with the seal, a draft layer, or a layer of another PP stage; its signal
    /// completes nothing here).
    ///
    /// A model layer is never an error, whichever stage asks: per-layer hooks fire for every
    /// layer of the forward, and a caller streaming only some layers' groups signals them all.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a layer id no model layer has: negative, or past the
    /// model's layers and in no caller set.
    pub fn slice_of_layer(&self, layer: i64) -> Result<Option<usize>> {
        if let Some(&s) = self.layer_slice.get(&layer) {
            return Ok(Some(s));
        }
        // A layer of a listed group (a caller set may name ids past the announced count).
        let listed = self.groups.group_of(layer).is_some_and(|g| {
            (g as usize) < self.slices.len()
                && self.groups.layers_of(g, self.n_layers).contains(&layer)
        });
        let in_model = u64::try_from(layer).is_ok_and(|l| l < self.n_layers);
        if listed || in_model || self.other_layers.binary_search(&layer).is_ok() {
            return Ok(None);
        }
        let held: Vec<i64> = self.layer_slice.keys().copied().collect();
        Err(PlanError::Geometry {
            what: format!(
                "layer {layer} is not a layer of this model (model layers 0..{}, {} groups; \
                 this template streams layers {})",
                self.n_layers,
                self.slices.len(),
                crate::model::layer_groups::ids_text(&held)
            ),
        })
    }

    /// Cuts one plan of this template (page, token or state plan, described by its summary)
    /// into slices: per slice its block ranges and work, and the seal's.
    ///
    /// A plan with a state tail (a page request carrying a state slot) is its page plan's
    /// slices followed by its state plan's, each slice's state ranges after its page ranges.
    pub fn of(&self, template: &Template, summary: &PlanSummary) -> PlanSlices {
        if let Some(tail) = summary.state {
            let head = summary.head();
            let at = head.n_blocks;
            let mut out = self.of(template, &head);
            let state = self.of(template, &tail.summary());
            let join = |ranges: &mut Vec<(usize, usize)>,
                        work: &mut SliceWork,
                        more: &[(usize, usize)],
                        more_work: &SliceWork| {
                for &(start, stop) in more {
                    let (start, stop) = (start + at, stop + at);
                    match ranges.last_mut() {
                        Some(last) if last.1 == start => last.1 = stop,
                        _ => ranges.push((start, stop)),
                    }
                }
                work.blocks += more_work.blocks;
                work.bytes += more_work.bytes;
            };
            for (k, (ranges, work)) in out.ranges.iter_mut().zip(&mut out.work).enumerate() {
                join(ranges, work, &state.ranges[k], &state.work[k]);
            }
            join(
                &mut out.seal_ranges,
                &mut out.seal,
                &state.seal_ranges,
                &state.seal,
            );
            return out;
        }
        let (ranges, work): (Vec<_>, Vec<_>);
        let (seal_ranges, seal);
        if matches!(summary.unit, PlanUnit::State(_)) {
            // A state plan: block k is the k-th moving state pair's, with its layer's group.
            let spans = |blocks: &[usize]| -> Vec<(usize, usize, u64)> {
                let blocks = blocks.iter().filter(|&&k| k < summary.n_blocks);
                let bytes = |k: usize| template.blocks().group_bytes(k, summary).unwrap_or(0);
                blocks.map(|&k| (k, k + 1, bytes(k))).collect()
            };
            (ranges, work) = self
                .slices
                .iter()
                .map(|s| merged_work(spans(&s.state_blocks), s.layer_group))
                .unzip();
            // Ring rows follow the slots' blocks and go with the seal: a position's rows are
            // final only once every layer has processed it.
            let mut seal_spans = spans(&self.seal_state_blocks);
            seal_spans.extend(template.blocks().ring_span(summary));
            (seal_ranges, seal) = merged_work(seal_spans, WorkManifest::SEAL);
        } else {
            let offsets = template.blocks().group_offsets(summary);
            let spans = |groups: &[usize]| -> Vec<(usize, usize, u64)> {
                // The template's own count (what this rank pair moves: under decode context
                // parallelism only the tokens the decode rank holds), never a re-derivation.
                // It cannot fail here: a group moves at most the plan's bytes, which fit u64,
                // and only a template that plans by token has a token summary.
                let spans = groups.iter().map(|&g| {
                    let bytes = template.blocks().group_bytes(g, summary).unwrap_or(0);
                    (offsets[g], offsets[g + 1], bytes)
                });
                spans.collect()
            };
            (ranges, work) = self
                .slices
                .iter()
                .map(|s| merged_work(spans(&s.emission_groups), s.layer_group))
                .unzip();
            (seal_ranges, seal) =
                merged_work(spans(&self.seal_emission_groups), WorkManifest::SEAL);
        }
        PlanSlices {
            ranges,
            work,
            seal_ranges,
            seal,
        }
    }

    /// Cuts a batch plan of this template into slices: each segment as [`LayerSlices::of`]
    /// cuts a plan laid out by its summary ([`BatchSummary::segment_summary`]), with its block
    /// ranges offset to where the segment lies in the batch.
    pub fn of_batch(&self, template: &Template, batch: &BatchSummary) -> BatchSlices {
        let segments = (0..batch.n_segments())
            .map(|s| {
                let Some(summary) = batch.segment_summary(s) else {
                    return PlanSlices::default();
                };
                let mut cut = self.of(template, &summary);
                let at = batch.segment_offsets[s];
                let shift = |ranges: &mut Vec<(usize, usize)>| {
                    for r in ranges.iter_mut() {
                        *r = (r.0 + at, r.1 + at);
                    }
                };
                cut.ranges.iter_mut().for_each(shift);
                shift(&mut cut.seal_ranges);
                cut
            })
            .collect();
        BatchSlices {
            segments,
            segment_requests: batch.segment_requests.clone(),
            n_slices: self.slices.len(),
        }
    }

    /// Page pairs of the template these slices were cut for (a cheap identity check).
    pub fn n_pairs(&self) -> usize {
        self.n_pairs
    }
}

impl PlanSlices {
    /// The expected-work manifest of one request between this (prefill, decode) peer pair:
    /// every slice's blocks and bytes, and the seal's, with `extra` (the request's state plan,
    /// cut by the same slices) added slice by slice and to the seal.
    pub fn manifest(
        &self,
        request: u64,
        peers: (PeerRanks, PeerRanks),
        extra: Option<&PlanSlices>,
    ) -> WorkManifest {
        let mut seal = self.seal;
        let mut slices = self.work.clone();
        if let Some(state) = extra {
            seal.blocks += state.seal.blocks;
            seal.bytes += state.seal.bytes;
            for (slice, more) in slices.iter_mut().zip(&state.work) {
                slice.blocks += more.blocks;
                slice.bytes += more.bytes;
            }
        }
        WorkManifest {
            request,
            prefill: peers.0,
            decode: peers.1,
            slices,
            seal,
        }
    }
}

/// A batch plan cut into slices ([`LayerSlices::of_batch`]): per segment its slices, with block
/// ranges in the batch. One engine call per ready slice (or a few, bounded) then covers every
/// request of the batch, and each call names the requests whose blocks it holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchSlices {
    /// Per segment, its slices (block ranges in the batch, in batch order).
    pub segments: Vec<PlanSlices>,
    /// `n_segments + 1` request offsets, as [`BatchSummary::segment_requests`].
    pub segment_requests: Vec<usize>,
    /// Slices per segment (the template's layer groups).
    pub n_slices: usize,
}

/// What part of a batch's slices a call sends: some slices, or the seal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchPart<'a> {
    /// These slices (indices into [`LayerSlices::slices`]) of every segment.
    Slices(&'a [usize]),
    /// Every segment's seal.
    Seal,
}

/// One engine call over a batch's slices: its block ranges in the batch (ascending, touching
/// ones merged), their block count, and the requests whose bytes they hold.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchCall {
    /// `(start, stop)` block ranges in the batch.
    pub ranges: Vec<(usize, usize)>,
    /// Blocks over the ranges.
    pub blocks: usize,
    /// Requests the ranges hold blocks of, ascending.
    pub requests: Vec<usize>,
}

impl BatchCall {
    fn push(&mut self, (start, stop): (usize, usize), segment_requests: std::ops::Range<usize>) {
        match self.ranges.last_mut() {
            Some(last) if last.1 == start => last.1 = stop,
            _ => self.ranges.push((start, stop)),
        }
        self.blocks += stop - start;
        if self
            .requests
            .last()
            .is_none_or(|&r| r < segment_requests.start)
        {
            self.requests.extend(segment_requests);
        }
    }
}

impl BatchSlices {
    /// Segments of the batch.
    pub fn n_segments(&self) -> usize {
        self.segments.len()
    }

    /// Segment `segment`'s block ranges of `part` in the batch, ascending, touching ones merged.
    fn part_ranges(&self, segment: usize, part: BatchPart<'_>) -> Vec<(usize, usize)> {
        let cut = &self.segments[segment];
        let mut ranges: Vec<(usize, usize)> = match part {
            BatchPart::Slices(ks) => ks
                .iter()
                .filter_map(|&k| cut.ranges.get(k))
                .flatten()
                .copied()
                .collect(),
            BatchPart::Seal => cut.seal_ranges.clone(),
        };
        ranges.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(last) if last.1 == a => last.1 = b,
                _ if a == b => {}
                _ => merged.push((a, b)),
            }
        }
        merged
    }

    /// The engine calls that send `part` of every segment, each of at most `max_blocks` blocks
    /// (`None`: one call): whole segments packed in batch order while they fit, a segment
    /// larger than the bound split alone (its last piece packed with what follows), as
    /// [`BatchSummary::call_ranges`] packs a whole batch. A failed call then holds as few
    /// requests as the sizes allow. Segments with no blocks in `part` are in no call, and so
    /// are those `skip` flags (empty: none; a streamer leaves out the segments of requests
    /// already failed, so a failed request never takes its neighbours down in a later call).
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for `max_blocks` 0, a slice index past the slices, or `skip`
    /// of another length than the segments.
    pub fn calls(
        &self,
        part: BatchPart<'_>,
        max_blocks: Option<usize>,
        skip: &[bool],
    ) -> Result<Vec<BatchCall>> {
        if !skip.is_empty() && skip.len() != self.n_segments() {
            return Err(PlanError::Geometry {
                what: format!(
                    "skip flags {} segments of a batch of {}",
                    skip.len(),
                    self.n_segments()
                ),
            });
        }
        if max_blocks == Some(0) {
            return Err(PlanError::Geometry {
                what: "max_blocks must be at least 1, got 0".into(),
            });
        }
        if let BatchPart::Slices(ks) = part
            && let Some(&k) = ks.iter().find(|&&k| k >= self.n_slices)
        {
            return Err(PlanError::Geometry {
                what: format!("slice {k} out of range for {} slices", self.n_slices),
            });
        }
        let max = max_blocks.unwrap_or(usize::MAX);
        let mut calls = Vec::new();
        let mut call = BatchCall::default();
        for s in 0..self.n_segments() {
            if skip.get(s).copied().unwrap_or(false) {
                continue;
            }
            let ranges = self.part_ranges(s, part);
            let blocks: usize = ranges.iter().map(|(a, b)| b - a).sum();
            if blocks == 0 {
                continue;
            }
            let requests = self.segment_requests[s]..self.segment_requests[s + 1];
            if call.blocks + blocks > max && call.blocks > 0 {
                calls.push(std::mem::take(&mut call));
            }
            for (mut a, b) in ranges {
                while a < b {
                    let take = (b - a).min(max - call.blocks);
                    call.push((a, a + take), requests.clone());
                    a += take;
                    if call.blocks == max {
                        calls.push(std::mem::take(&mut call));
                    }
                }
            }
        }
        if call.blocks > 0 {
            calls.push(call);
        }
        Ok(calls)
    }

    /// The slices segment `segment` has blocks in, ascending, and whether its seal has any:
    /// what must land before its requests are complete.
    pub fn segment_parts(&self, segment: usize) -> (Vec<usize>, bool) {
        let Some(cut) = self.segments.get(segment) else {
            return (Vec::new(), false);
        };
        let slices = (0..cut.ranges.len())
            .filter(|&k| cut.ranges[k].iter().any(|(a, b)| b > a))
            .collect();
        (slices, cut.seal_ranges.iter().any(|(a, b)| b > a))
    }
}

/// What one prefill peer sends one decode peer for one request: per layer group its blocks and
/// bytes, and the seal's. A decode that holds the manifests of every prefill peer sending to
/// it knows the request is complete when every listed slice (and each seal) has arrived, and a
/// slice missing from the arrivals is missing, not slow, once its peer reports the request sent.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkManifest {
    /// The caller's request id.
    pub request: u64,
    /// The sending prefill peer.
    pub prefill: PeerRanks,
    /// The receiving decode peer.
    pub decode: PeerRanks,
    /// Per layer group, in group id order.
    pub slices: Vec<SliceWork>,
    /// The seal (group [`WorkManifest::SEAL`]).
    pub seal: SliceWork,
}

const MANIFEST_MAGIC: &[u8; 4] = b"KVSM";
const MANIFEST_VERSION: u16 = 1;
/// Header: magic, version, reserved, request, 8 rank fields, slice count.
const MANIFEST_HEADER: usize = 4 + 2 + 2 + 8 + 8 * 4 + 4;
const MANIFEST_MAX_SLICES: usize = 1 << 20;

impl WorkManifest {
    /// The group id the seal carries.
    pub const SEAL: u64 = u64::MAX;

    /// Blocks over every slice and the seal.
    pub fn total_blocks(&self) -> u64 {
        self.slices.iter().map(|s| s.blocks).sum::<u64>() + self.seal.blocks
    }

    /// Bytes over every slice and the seal.
    pub fn total_bytes(&self) -> u64 {
        self.slices.iter().map(|s| s.bytes).sum::<u64>() + self.seal.bytes
    }

    /// Little-endian wire bytes: magic `KVSM`, version 1, the request id, both peers' PP and
    /// TP ranks and sizes, the slices (group, blocks, bytes) and the seal (blocks, bytes), then
    /// a CRC-32 of everything before it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MANIFEST_HEADER + 24 * self.slices.len() + 20);
        out.extend_from_slice(MANIFEST_MAGIC);
        out.extend_from_slice(&MANIFEST_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.request.to_le_bytes());
        for p in [self.prefill, self.decode] {
            for v in [p.pp_rank, p.pp_size, p.tp_rank, p.tp_size] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.extend_from_slice(&(self.slices.len() as u32).to_le_bytes());
        for s in &self.slices {
            for v in [s.layer_group, s.blocks, s.bytes] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.extend_from_slice(&self.seal.blocks.to_le_bytes());
        out.extend_from_slice(&self.seal.bytes.to_le_bytes());
        let crc = crate::exchange::wire::crc32(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes [`WorkManifest::to_bytes`] output.
    ///
    /// # Errors
    /// [`PlanError::Wire`] for a wrong magic, an unknown version, a length that does not match
    /// the slice count, too many slices, or a CRC mismatch.
    pub fn from_bytes(data: &[u8]) -> Result<Self> {
        let wire = |what: String| PlanError::Wire { what };
        if data.len() < MANIFEST_HEADER + 20 {
            return Err(wire(format!(
                "a manifest is at least {} bytes, got {}",
                MANIFEST_HEADER + 20,
                data.len()
            )));
        }
        if &data[..4] != MANIFEST_MAGIC {
            return Err(wire(format!(
                "not a manifest: magic {:?}, expected \"KVSM\"",
                &data[..4]
            )));
        }
        let u16_at = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().unwrap_or([0; 8]));
        let version = u16_at(4);
        if version != MANIFEST_VERSION {
            return Err(wire(format!(
                "manifest version {version} is not supported (this build reads version {MANIFEST_VERSION})"
            )));
        }
        let n = u32_at(MANIFEST_HEADER - 4) as usize;
        if n > MANIFEST_MAX_SLICES {
            return Err(wire(format!(
                "manifest lists {n} slices, more than the {MANIFEST_MAX_SLICES} allowed"
            )));
        }
        let expected = MANIFEST_HEADER + 24 * n + 16 + 4;
        if data.len() != expected {
            return Err(wire(format!(
                "a manifest of {n} slices is {expected} bytes, got {}",
                data.len()
            )));
        }
        let body = expected - 4;
        let (stored, computed) = (u32_at(body), crate::exchange::wire::crc32(&data[..body]));
        if stored != computed {
            return Err(wire(format!(
                "manifest CRC-32 mismatch: stored {stored:#010x}, computed {computed:#010x}"
            )));
        }
        let ranks = |at: usize| PeerRanks {
            pp_rank: u32_at(at),
            pp_size: u32_at(at + 4),
            tp_rank: u32_at(at + 8),
            tp_size: u32_at(at + 12),
        };
        let slices = (0..n)
            .map(|k| {
                let at = MANIFEST_HEADER + 24 * k;
                SliceWork {
                    layer_group: u64_at(at),
                    blocks: u64_at(at + 8),
                    bytes: u64_at(at + 16),
                }
            })
            .collect();
        let seal_at = MANIFEST_HEADER + 24 * n;
        Ok(Self {
            request: u64_at(8),
            prefill: ranks(16),
            decode: ranks(32),
            slices,
            seal: SliceWork {
                layer_group: Self::SEAL,
                blocks: u64_at(seal_at),
                bytes: u64_at(seal_at + 8),
            },
        })
    }
}

/// The error for an emission group whose pairs `first` and `other` belong to different slices.
fn straddle(template: &Template, keys: &[SliceKey], first: usize, other: usize) -> PlanError {
    let (src, _) = template.layouts();
    let name = |p: usize| {
        let layer =
            crate::model::layer_groups::EntryTag::of(src, template.page_pairs()[p].src_entry)
                .layer
                .map_or_else(|| "no layer id".to_string(), |l| format!("layer {l}"));
        let key = match keys[p] {
            SliceKey::LayerGroup(g) => format!("layer group {g}"),
            SliceKey::Seal => "the seal".to_string(),
        };
        format!("page pair {p} ({layer}, {key})")
    };
    PlanError::Geometry {
        what: format!(
            "{} and {} are coalesced into one block per run, so neither can be sent alone; \
             build the template with these layer groups (Template::with_layer_groups, \
             Template(..., layer_groups=...)) so coalescing stops at group edges",
            name(first),
            name(other)
        ),
    }
}

/// One slice's block ranges (adjacent spans merged, empty ones dropped) and its work, from its
/// `(start, stop, bytes)` spans in plan order.
fn merged_work(
    spans: Vec<(usize, usize, u64)>,
    layer_group: u64,
) -> (Vec<(usize, usize)>, SliceWork) {
    let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(spans.len().min(4));
    let mut bytes = 0u64;
    for (start, stop, span_bytes) in spans {
        bytes += span_bytes;
        if start == stop {
            continue;
        }
        match ranges.last_mut() {
            Some(last) if last.1 == start => last.1 = stop,
            _ => ranges.push((start, stop)),
        }
    }
    let blocks = ranges.iter().map(|(a, b)| (b - a) as u64).sum();
    (
        ranges,
        SliceWork {
            layer_group,
            blocks,
            bytes,
        },
    )
}
