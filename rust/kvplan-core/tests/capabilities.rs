//! Every planner against every request feature: a feature its row of
//! `capabilities::SUPPORT` declares is planned, any other is `PlanError::Unsupported` naming
//! the planner and the feature, so the declaration (and the docs generated from it) is what
//! the planners do.

mod support;

use kvplan_core::rules::capabilities::check;
use kvplan_core::{
    BatchPlanner, DescriptorTables, Feature, Layout, PackBuffer, PackPlanner, PlanError, Planner,
    PoolId, Request, RoundsPlanner, StagedPlanner, StagingRegion, StateChannels, Template,
    TemplateOptions,
};
use support::layouts::{ContextBuilder, KvLayout, paged, with_slots};

const PAGE: u64 = 4;
const ITEM: u64 = 64;
const PAGES: u64 = 32;
const SRC: u64 = 1 << 32;
const DST: u64 = 1 << 40;

/// Two MLA layers of `page_size`-token pages (16 bytes a token) and a state entry per layer,
/// at `base`.
fn layout(base: u64, page_size: u64) -> Layout {
    let item = ITEM / PAGE * page_size;
    let pages = KvLayout::mla(base, [0, 1], item, item * PAGES)
        .context(paged(page_size))
        .build();
    with_slots(
        pages,
        "ssm",
        vec![base + (1 << 24), base + (1 << 25)],
        8,
        32,
        vec![0, 1],
    )
}

fn template(src: Layout, dst: Layout) -> Template {
    Template::new(&src, &dst, TemplateOptions::default()).unwrap()
}

/// The template a feature's request is planned on: a page template, for `Window` one whose
/// first layer keeps a sliding window (without state entries: windows are page entries'), for
/// `Ring` one whose state entries are rings of 2 rows per request, for `PoolRange` one whose
/// second layer is in a pool of its own.
fn template_for(feature: Feature) -> Template {
    match feature {
        Feature::PoolRange => {
            let pooled = |base| {
                KvLayout::mla(base, [0, 1], ITEM, ITEM * PAGES)
                    .context(paged(PAGE))
                    .build()
                    .with_pool(&[1], PAGE, 1)
                    .unwrap()
            };
            template(pooled(SRC), pooled(DST))
        }
        Feature::Window => {
            let windowed = |base| {
                KvLayout::mla(base, [0, 1], ITEM, ITEM * PAGES)
                    .context(paged(PAGE))
                    .build()
                    .with_windows(vec![Some(6), None])
                    .unwrap()
            };
            template(windowed(SRC), windowed(DST))
        }
        Feature::Ring => {
            let rings = |base| {
                layout(base, PAGE)
                    .with_rings(vec![None, None, Some(2), Some(2)])
                    .unwrap()
            };
            template(rings(SRC), rings(DST))
        }
        Feature::SlicedState => {
            // The state entries as two sub-blocks of 8 channels (2 bytes each) at TP 1, from
            // prefill TP 1 to decode rank 0 of TP 2: two byte slices per state pair.
            let split = |base, tp: u32| {
                let t = u64::from(tp);
                let pages = KvLayout::mla(base, [0, 1], ITEM, ITEM * PAGES)
                    .context(paged(PAGE).tp(0, tp))
                    .build();
                let half = StateChannels::new(16 / t, 1, &[8, 8]).unwrap();
                with_slots(
                    pages,
                    "ssm",
                    vec![base + (1 << 24), base + (1 << 25)],
                    8,
                    32 / t,
                    vec![0, 1],
                )
                .with_state_channels(vec![None, None, Some(half), Some(half)])
                .unwrap()
            };
            template(split(SRC, 1), split(DST, 2))
        }
        _ => template(layout(SRC, PAGE), layout(DST, PAGE)),
    }
}

const SRC_PAGES: [i64; 4] = [3, 4, 9, 1];
const DST_PAGES: [i64; 4] = [10, 11, 2, 5];
static POOL_SRC_PAGES: [i64; 2] = [7, 8];
static POOL_DST_PAGES: [i64; 2] = [20, 13];

/// A request asking for `feature` (and, for a delta or window request, also a token plan,
/// which comes after it in the order refusals are reported; a ring request is a state slot
/// request, which comes before it).
fn request_for(feature: Feature) -> Request<'static> {
    match feature {
        Feature::Delta => Request::tokens(&SRC_PAGES, &DST_PAGES, 14).skipping(5),
        Feature::StateSlot | Feature::SlicedState => Request::slot(1, 2),
        Feature::Window | Feature::TokenPlan => Request::tokens(&SRC_PAGES, &DST_PAGES, 14),
        Feature::Ring => Request {
            n_tokens: Some(5),
            ..Request::slot(1, 2)
        },
        Feature::PoolRange => Request::tokens(&SRC_PAGES, &DST_PAGES, 14)
            .with_pool_pages(
                PoolId(1),
                Some(&POOL_SRC_PAGES[..]),
                Some(&POOL_DST_PAGES[..]),
            )
            .with_pool_tokens(PoolId(1), 6, 0),
        Feature::PagesWithState => Request::pages(&SRC_PAGES, &DST_PAGES).with_state_slot(1, 2),
    }
}

/// Plans `request` with `planner`; `Ok(())` when it planned.
fn plan_with(planner: Planner, t: &Template, request: &Request<'_>) -> Result<(), PlanError> {
    let pack = PackBuffer {
        addr: 1 << 48,
        size: 1 << 24,
    };
    let region = |addr| StagingRegion {
        addr,
        size: 1 << 24,
    };
    match planner {
        Planner::Plan => t.plan(request).map(drop),
        Planner::Batch => BatchPlanner::new(t).plan(&[*request]).map(drop),
        Planner::Packed => PackPlanner::new(t).plan(request, pack).map(drop),
        Planner::RowGather => PackPlanner::new(t).row_gather(request, pack).map(drop),
        Planner::Staged => StagedPlanner::new(t)
            .plan(request, region(1 << 50), region(1 << 52))
            .map(drop),
        Planner::Rounds => RoundsPlanner::new(t)
            .plan(request, region(1 << 50), region(1 << 52), 2)
            .map(drop),
        Planner::Descriptors => DescriptorTables::new(t).indices(request).map(drop),
    }
}

#[test]
fn every_planner_plans_what_it_declares_and_refuses_the_rest_by_name() {
    for planner in Planner::ALL {
        for feature in Feature::ALL {
            let t = template_for(feature);
            let request = request_for(feature);
            let what = format!("{} with {}", planner.name(), feature.name());
            let asked = t.asked_by(&request);
            assert!(asked.has(feature), "{what}: the request asks for it");
            let result = plan_with(planner, &t, &request);
            if planner.supports(feature) {
                assert_eq!(result, Ok(()), "{what}");
                assert_eq!(check(planner, &asked), Ok(()), "{what}");
                continue;
            }
            let err = result.expect_err(&what);
            // The refusal names the first feature (in the reporting order) the request asks
            // and the planner refuses: the feature itself, but for a ring request to a planner
            // that takes no state slot at all.
            let refused = Feature::ALL
                .into_iter()
                .find(|f| asked.has(*f) && !planner.supports(*f))
                .expect(&what);
            match &err {
                // A batch names the request whose error it is.
                PlanError::InRequest { request: 0, source } if planner == Planner::Batch => {
                    assert!(
                        matches!(**source, PlanError::Unsupported { .. }),
                        "{what}: {err}"
                    );
                }
                PlanError::Unsupported {
                    planner: p,
                    feature: f,
                    why,
                } => {
                    assert_eq!((*p, *f), (planner.name(), refused.name()), "{what}");
                    assert!(!why.is_empty(), "{what}");
                }
                other => panic!("{what}: expected Unsupported, got {other:?}"),
            }
            assert_eq!(err.kind(), "unsupported", "{what}");
            // A batch's message leads with the request it names, then the refusal.
            let refusal = match &err {
                PlanError::InRequest { source, .. } => source.to_string(),
                other => other.to_string(),
            };
            assert!(
                refusal.starts_with(&format!(
                    "{} does not support {}: ",
                    planner.name(),
                    refused.name()
                )),
                "{what}: {err}"
            );
        }
    }
}

#[test]
fn a_plain_page_request_is_planned_by_every_planner_but_the_row_gather() {
    // No feature asked: nothing to refuse (the row gather plans token requests only, a
    // requirement of its own, not a feature).
    let t = template(layout(SRC, PAGE), layout(DST, PAGE));
    let request = Request::pages(&SRC_PAGES, &DST_PAGES);
    for planner in Planner::ALL {
        let result = plan_with(planner, &t, &request);
        if planner == Planner::RowGather {
            assert!(
                matches!(result, Err(PlanError::Geometry { .. })),
                "{result:?}"
            );
        } else {
            assert_eq!(result, Ok(()), "{}", planner.name());
        }
    }
}

#[test]
fn descriptor_tables_of_a_token_template_name_the_token_plan() {
    let t = template(layout(SRC, PAGE), layout(DST, 2 * PAGE));
    let err = DescriptorTables::new(&t)
        .table(kvplan_core::Side::Src)
        .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::Unsupported {
                planner: "descriptor_table",
                feature: "token_plan",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("prefill pages hold 4 tokens and decode pages 8"),
        "{err}"
    );
}
