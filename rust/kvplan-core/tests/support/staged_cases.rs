//! The staged and round tests' cases: one MHA request between two TP ranks (with PP stages and
//! hybrid state when the case says so), its pages on each side in token order with a gap and
//! swapped pairs, and each rank's layout.

use kvplan_core::{Layout, MemoryOrder, Request, Side, Template, TemplateOptions, TpSplit};

use super::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, heads, paged, with_slots};

/// Where the prefill's pages start.
pub const SRC_BASE: u64 = 0x1000_0000;
/// Where the decode's pages start.
pub const DST_BASE: u64 = 0x8000_0000;
/// Bytes of one state slot.
pub const STATE_ITEM: u64 = 24;

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub heads: u32,
    pub tp_p: u32,
    pub tp_d: u32,
    pub order: MemoryOrder,
    pub pp_p: u32,
    pub page_sizes: (u64, u64),
    /// Passed as `n_tokens` when the page sizes differ (the full pages of the shorter side
    /// otherwise).
    pub tokens: u64,
    pub state: bool,
    pub layers: u32,
}

impl Case {
    pub fn page_size(&self, side: Side) -> u64 {
        side.pick(self.page_sizes.0, self.page_sizes.1)
    }

    /// Pages per pool: the request's and three more.
    pub fn capacity(&self, side: Side) -> u64 {
        self.tokens.div_ceil(self.page_size(side)) + 3
    }

    /// The request's pages on one side, in token order: a run, a gap, swapped pairs.
    pub fn pages(&self, side: Side) -> Vec<i64> {
        let needed = self.tokens.div_ceil(self.page_size(side)) as i64;
        let capacity = self.capacity(side) as i64;
        match side {
            Side::Src => (0..capacity)
                .filter(|&p| p != 1)
                .take(needed as usize)
                .collect(),
            Side::Dst => (0..needed)
                .map(|i| (capacity - 1 - (i ^ 1)).max(0))
                .collect(),
        }
    }

    pub fn n_tokens(&self) -> Option<u64> {
        (self.page_sizes.0 != self.page_sizes.1).then_some(self.tokens)
    }
}

/// One rank's MHA layout (every layer's K entry, then every V entry, 64 bytes apart) with a
/// state entry per layer when the case has state.
pub fn layout(case: &Case, side: Side, tp_rank: u32, stage: u32) -> Layout {
    let split = TpSplit::new(case.heads, case.tp_p, case.tp_d).unwrap();
    let (tp, pp) = side.pick((case.tp_p, case.pp_p), (case.tp_d, 1));
    let per_rank = split.heads_per_rank(side);
    let page_size = case.page_size(side);
    let item = page_size * u64::from(per_rank) * HEAD_BYTES;
    let entry_len = item * case.capacity(side);
    let per_stage = case.layers / pp;
    let layers: Vec<i64> = (stage * per_stage..(stage + 1) * per_stage)
        .map(i64::from)
        .collect();
    let context = paged(page_size)
        .model_layers(u64::from(case.layers))
        .pp(stage, pp)
        .tp(tp_rank, tp)
        .attention(heads(case.heads, per_rank, case.order));
    let pages = KvLayout::mha(
        side.pick(SRC_BASE, DST_BASE),
        layers.clone(),
        item,
        entry_len,
    )
    .spaced(entry_len + 64)
    .context(context);
    let state_base = pages.end();
    let layout = pages.build();
    if !case.state {
        return layout;
    }
    let state_ptrs = (0..layers.len() as u64)
        .map(|i| state_base + i * STATE_ITEM * 4)
        .collect();
    with_slots(layout, "conv", state_ptrs, 4, STATE_ITEM, layers)
}

/// A small deterministic generator.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    pub fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[(self.next() % from.len() as u64) as usize]
    }
}

/// One drawn case and the ranks it plans between: decode rank `r_d`, one of its prefill ranks
/// `r_p`, and that rank's PP `stage`.
#[derive(Clone, Copy, Debug)]
pub struct Drawn {
    pub case: Case,
    pub r_p: u32,
    pub r_d: u32,
    pub stage: u32,
}

impl Drawn {
    /// The pair planned: each rank's layout, their template and the request's pages.
    pub fn pair(&self) -> Pair {
        let src = layout(&self.case, Side::Src, self.r_p, self.stage);
        let dst = layout(&self.case, Side::Dst, self.r_d, 0);
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        Pair {
            drawn: *self,
            src,
            dst,
            template,
            pages: (self.case.pages(Side::Src), self.case.pages(Side::Dst)),
        }
    }
}

/// A drawn case's prefill rank (and stage) and decode rank with their layouts, the template
/// between them and the request's pages on each side.
pub struct Pair {
    pub drawn: Drawn,
    pub src: Layout,
    pub dst: Layout,
    pub template: Template,
    pub pages: (Vec<i64>, Vec<i64>),
}

impl Pair {
    /// The whole request: every page, with `n_tokens` when the page sizes differ.
    pub fn request(&self) -> Request<'_> {
        Request::new(&self.pages.0, &self.pages.1, self.drawn.case.n_tokens())
    }
}

/// Draws a case over `page_sizes`: heads in {1, 2, 8, 16}, TP sizes in {1, 2, 4, 8} on each
/// side, either memory order, prefill PP 1 or 2, two layers. Equal page sizes take whole pages
/// (and, with `odd_pages`, sometimes one page more); different ones a token count past the
/// larger page. With `state`, a third of the cases hold state slots. `None` when the heads do
/// not split between the two TP sizes (draw again).
pub fn draw(
    rng: &mut Lcg,
    page_sizes: &[(u64, u64)],
    odd_pages: bool,
    state: bool,
) -> Option<Drawn> {
    let heads = rng.pick(&[1, 2, 8, 16]);
    let (tp_p, tp_d) = (rng.pick(&[1, 2, 4, 8]), rng.pick(&[1, 2, 4, 8]));
    let split = TpSplit::new(heads, tp_p, tp_d).ok()?;
    let page_sizes = rng.pick(page_sizes);
    let tokens = if page_sizes.0 == page_sizes.1 {
        let whole = page_sizes.0.max(3) * (1 + rng.next() % 3);
        if odd_pages {
            whole + rng.next() % 2 * page_sizes.0
        } else {
            whole
        }
    } else {
        page_sizes.0.max(page_sizes.1) + 1 + rng.next() % 9
    };
    let case = Case {
        heads,
        tp_p,
        tp_d,
        order: rng.pick(&[MemoryOrder::Nhd, MemoryOrder::Hnd]),
        pp_p: rng.pick(&[1, 2]),
        page_sizes,
        tokens,
        state: state && rng.next().is_multiple_of(3),
        layers: 2,
    };
    let r_d = (rng.next() % u64::from(tp_d)) as u32;
    let peers: Vec<u32> = split.peers(Side::Dst, r_d).ok()?.into_iter().collect();
    let r_p = rng.pick(&peers);
    let stage = (rng.next() % u64::from(case.pp_p)) as u32;
    Some(Drawn {
        case,
        r_p,
        r_d,
        stage,
    })
}
