//! The stages of every multi-stage plan, written once in the core (`planners::stages`): each
//! form lists its stages in the order they run, and the blocks of real plans lie in the
//! memories their stages say they read and write (a staged plan, its rounds, a pack plan and a
//! direct plan over TP sizes, head counts, memory orders, PP and page-size ratios).

mod support;

use kvplan_core::{
    Arena, MultiStage, PackBuffer, PackPlanner, Part, Plan, PlanForm, Role, RoundBlocks,
    RoundsPlanner, Side, Stage, StagedPlanner, StagingRegion,
};
use support::staged_cases::{DST_BASE, Drawn, Lcg, SRC_BASE, draw};

const SRC_STAGING: u64 = 0x4000_0000;
const DST_STAGING: u64 = 0xC000_0000;

/// `(kind, side, part, reads, writes)` of a stage, by name.
type Names = (
    &'static str,
    Option<Side>,
    Option<&'static str>,
    &'static str,
    &'static str,
);

/// The names of each stage.
fn described(stages: &[Stage]) -> Vec<Names> {
    stages
        .iter()
        .map(|s| {
            (
                s.kind.name(),
                s.kind.side(),
                s.part.name(),
                s.reads.name(),
                s.writes.name(),
            )
        })
        .collect()
}

#[test]
fn every_form_lists_its_stages_in_order() {
    use Side::{Dst, Src};
    let gather = ("copy", Some(Src), Some("gather"), "src", "src_staging");
    let staged = vec![
        gather,
        (
            "network",
            None,
            Some("network"),
            "src_staging",
            "dst_staging",
        ),
        ("copy", Some(Dst), Some("scatter"), "dst_staging", "dst"),
    ];
    assert_eq!(
        described(PlanForm::Direct.stages()),
        [("network", None, None, "src", "dst")]
    );
    assert_eq!(described(PlanForm::Staged.stages()), staged);
    assert_eq!(described(PlanForm::Rounds.stages()), staged);
    assert_eq!(
        described(PlanForm::Packed.stages()),
        [
            gather,
            ("network", None, Some("network"), "src_staging", "dst")
        ]
    );
    assert_eq!(
        described(PlanForm::RowGather.stages()),
        [
            ("rows", Some(Src), Some("rows"), "src", "src_staging"),
            ("network", None, Some("network"), "src_staging", "dst")
        ]
    );
    assert_eq!(
        described(PlanForm::Conversion(Src).stages()),
        [
            gather,
            ("convert", Some(Src), None, "src_staging", "src_staging"),
            ("network", None, Some("network"), "src_staging", "dst"),
            ("copy", Some(Dst), Some("scatter"), "dst", "dst")
        ]
    );
    assert_eq!(
        described(PlanForm::Conversion(Dst).stages()),
        [
            gather,
            (
                "network",
                None,
                Some("network"),
                "src_staging",
                "dst_staging"
            ),
            ("convert", Some(Dst), None, "dst_staging", "dst"),
            ("copy", Some(Dst), Some("scatter"), "dst_staging", "dst")
        ]
    );
    // Every form is found by its name, and no other name is a form.
    for form in PlanForm::ALL {
        assert_eq!(PlanForm::named(form.name()), Some(form));
    }
    for name in ["", "Staged", "convert", "pack", "direct "] {
        assert_eq!(PlanForm::named(name), None, "{name:?}");
    }
    // Each stage's side: the gather and rows on the prefill, the scatter and a decode-side
    // conversion on the decode, the network on neither.
    for form in PlanForm::ALL {
        for s in form.stages() {
            let side = match (s.reads, s.writes) {
                (_, Role::SrcStaging) => Some(Src),
                (Role::Src, Role::Dst) | (Role::SrcStaging, _) => None,
                _ => Some(Dst),
            };
            assert_eq!(s.kind.side(), side, "{form:?} {s:?}");
        }
    }
}

/// The address ranges of the four memories: each side's KV memory below its staging region.
fn role_range(role: Role, (src_size, dst_size): (u64, u64)) -> (u64, u64) {
    match role {
        Role::Src => (SRC_BASE, SRC_STAGING),
        Role::SrcStaging => (SRC_STAGING, SRC_STAGING + src_size),
        Role::DstStaging => (DST_STAGING, DST_STAGING + dst_size),
        Role::Dst => (DST_BASE, DST_STAGING),
    }
}

/// Asserts every block of `blocks` reads inside `stage.reads` and writes inside
/// `stage.writes`; returns the bytes.
fn check_stage(stage: Stage, blocks: &[(u64, u64, u64)], sizes: (u64, u64), what: &str) -> u64 {
    let (reads, writes) = (
        role_range(stage.reads, sizes),
        role_range(stage.writes, sizes),
    );
    for &(s, d, l) in blocks {
        assert!(
            s >= reads.0 && s + l <= reads.1,
            "{what}: {stage:?} reads [{s:#x}, +{l}) outside {:?}",
            stage.reads
        );
        assert!(
            d >= writes.0 && d + l <= writes.1,
            "{what}: {stage:?} writes [{d:#x}, +{l}) outside {:?}",
            stage.writes
        );
    }
    blocks.iter().map(|b| b.2).sum()
}

fn triples(plan: &Plan) -> Vec<(u64, u64, u64)> {
    (0..plan.lengths.len())
        .map(|k| (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]))
        .collect()
}

fn round_triples(blocks: &RoundBlocks) -> Vec<(u64, u64, u64)> {
    (0..blocks.n_blocks)
        .map(|k| {
            (
                blocks.src_addrs()[k],
                blocks.dst_addrs()[k],
                blocks.lengths()[k],
            )
        })
        .collect()
}

#[test]
fn plans_touch_only_the_memories_their_stages_name() {
    let page_sizes = [(1, 1), (16, 16), (4, 4), (16, 64), (64, 16), (4, 1)];
    let mut rng = Lcg(0x0057_A6E5);
    let mut done = 0;
    while done < 200 {
        let Some(drawn) = draw(&mut rng, &page_sizes, false, false) else {
            continue;
        };
        let pair = drawn.pair();
        let (template, request) = (&pair.template, pair.request());
        let Drawn {
            case,
            r_p,
            r_d,
            stage,
        } = drawn;
        let what = format!("{case:?} r_p={r_p} stage={stage} r_d={r_d}");

        let direct = template.plan(&request).unwrap();
        let [only] = direct.stages() else {
            panic!("a direct plan is one stage")
        };
        assert_eq!(only.part, Part::Whole);
        let bytes = check_stage(*only, &triples(&direct), (0, 0), &what);

        // The staged plan: every part where its stage says, each moving the request's bytes.
        let whole = StagingRegion {
            addr: 0,
            size: u64::MAX,
        };
        let need = StagedPlanner::new(template)
            .plan(&request, whole, whole)
            .unwrap();
        let sizes = (need.src_staging_bytes, need.dst_staging_bytes);
        let staged = StagedPlanner::new(template)
            .plan(
                &request,
                StagingRegion {
                    addr: SRC_STAGING,
                    size: sizes.0,
                },
                StagingRegion {
                    addr: DST_STAGING,
                    size: sizes.1,
                },
            )
            .unwrap();
        assert_eq!(staged.form(), PlanForm::Staged);
        for s in staged.stages() {
            let part = match s.part {
                Part::Gather => &staged.gather,
                Part::Network => &staged.network,
                Part::Scatter => &staged.scatter,
                other => panic!("a staged plan has no {other:?}"),
            };
            assert_eq!(check_stage(*s, &triples(part), sizes, &what), bytes);
        }

        // Its rounds through arenas of two round buffers of about a third of the request.
        let senders = u64::from(staged.writer.1) * u64::from(case.pp_p);
        let buffer = (bytes / 3).max(1);
        let arenas = (2 * buffer, 2 * buffer * senders);
        let rounds = RoundsPlanner::new(template)
            .plan(
                &request,
                Arena {
                    addr: SRC_STAGING,
                    size: arenas.0,
                },
                Arena {
                    addr: DST_STAGING,
                    size: arenas.1,
                },
                2,
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(rounds.form(), PlanForm::Rounds);
        for s in rounds.stages() {
            let part = match s.part {
                Part::Gather => &rounds.gather,
                Part::Network => &rounds.network,
                Part::Scatter => &rounds.scatter,
                other => panic!("a rounds plan has no {other:?}"),
            };
            assert_eq!(check_stage(*s, &round_triples(part), arenas, &what), bytes);
        }

        // The pack plan through a pack buffer of the request's bytes.
        let packed = PackPlanner::new(template)
            .plan(
                &request,
                PackBuffer {
                    addr: SRC_STAGING,
                    size: bytes,
                },
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(packed.form(), PlanForm::Packed);
        for s in packed.stages() {
            let part = match s.part {
                Part::Gather => &packed.gather,
                Part::Network => &packed.network,
                other => panic!("a pack plan has no {other:?}"),
            };
            assert_eq!(check_stage(*s, &triples(part), (bytes, 0), &what), bytes);
        }
        done += 1;
    }
}
