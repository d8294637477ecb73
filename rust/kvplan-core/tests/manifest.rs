//! Model manifests ([`check_manifest`]): a hybrid model's layouts (MLA on every 4th layer, four
//! state tensors on the others; an MHA model with alternating window layers) hold their manifest
//! at every PP split and TP size, and a layout missing any one component, with another item
//! size or window, or of another model is refused naming exactly that.

use kvplan_core::{
    Indexing, Layout, LayoutContext, ManifestComponent, ManifestProblem, ModelManifest, PlanError,
    Sharding, check_manifest, heads_per_rank_at, layer_ranges,
};

const LAYERS: i64 = 16;
const PAGE: u64 = 16;
const LATENT: u64 = 1152;
const STATES: [(&str, u64); 4] = [
    ("conv_q", 24_576),
    ("conv_k", 24_576),
    ("conv_v", 24_576),
    ("recurrent", 2_097_152),
];

fn mla_layer(layer: i64) -> bool {
    layer % 4 == 3
}

fn hybrid_manifest() -> ModelManifest {
    let mla: Vec<i64> = (0..LAYERS).filter(|&l| mla_layer(l)).collect();
    let linear: Vec<i64> = (0..LAYERS).filter(|&l| !mla_layer(l)).collect();
    let mut components = vec![component(
        "kv",
        Indexing::Page,
        mla,
        LATENT,
        Sharding::Replicated,
    )];
    for (name, bytes) in STATES {
        components.push(component(
            name,
            Indexing::State,
            linear.clone(),
            bytes,
            Sharding::Split,
        ));
    }
    ModelManifest {
        model: "hybrid".into(),
        num_layers: LAYERS as u64,
        components,
    }
}

fn component(
    role: &str,
    indexing: Indexing,
    layers: Vec<i64>,
    bytes: u64,
    sharding: Sharding,
) -> ManifestComponent {
    ManifestComponent {
        role: role.into(),
        indexing,
        layers,
        bytes,
        tokens_per_row: 1,
        sharding,
        window: None,
        ring: None,
    }
}

fn context(pp: (u32, u32), tp: (u32, u32)) -> LayoutContext {
    LayoutContext {
        page_size: PAGE,
        num_model_layers: Some(LAYERS as u64),
        pp_rank: pp.0,
        pp_size: pp.1,
        tp_rank: tp.0,
        tp_size: tp.1,
        ..LayoutContext::default()
    }
}

/// One rank's hybrid layout over `stage`, leaving out the states named in `skip` and the layer
/// `drop` (as an engine that never registered them publishes it); `recurrent` is the recurrent
/// state's bytes at TP 1.
fn hybrid(
    stage: std::ops::Range<i64>,
    pp: (u32, u32),
    tp: (u32, u32),
    skip: &[&str],
    drop: Option<i64>,
    recurrent: u64,
) -> Layout {
    let kept = |l: &i64| Some(*l) != drop;
    let mla: Vec<i64> = stage
        .clone()
        .filter(|&l| mla_layer(l))
        .filter(kept)
        .collect();
    let linear: Vec<i64> = stage
        .clone()
        .filter(|&l| !mla_layer(l))
        .filter(kept)
        .collect();
    let item = LATENT * PAGE;
    let ptrs = (0..mla.len() as u64)
        .map(|i| (1 << 32) + i * (1 << 20))
        .collect();
    let mut layout = Layout::mla(
        ptrs,
        vec![4 * item; mla.len()],
        vec![item; mla.len()],
        Some(mla),
        context(pp, tp),
    )
    .unwrap();
    for (k, (name, bytes)) in STATES.into_iter().enumerate() {
        if skip.contains(&name) || linear.is_empty() {
            continue;
        }
        let slot = if name == "recurrent" {
            recurrent
        } else {
            bytes
        } / u64::from(tp.1);
        let base = (2 << 32) + (k as u64) * (1 << 30);
        let ptrs = (0..linear.len() as u64)
            .map(|i| base + i * (1 << 24))
            .collect();
        layout = layout
            .with_state(
                name,
                ptrs,
                vec![4 * slot; linear.len()],
                vec![slot; linear.len()],
                linear.clone(),
            )
            .unwrap();
    }
    layout
}

fn stages(pp: u32) -> Vec<std::ops::Range<i64>> {
    let (base, extra) = (LAYERS / i64::from(pp), LAYERS % i64::from(pp));
    let mut start = 0;
    (0..i64::from(pp))
        .map(|s| {
            let n = base + i64::from(s < extra);
            start += n;
            start - n..start
        })
        .collect()
}

fn problems(result: kvplan_core::Result<()>) -> Vec<ManifestProblem> {
    match result {
        Err(PlanError::Manifest { problems, .. }) => problems,
        other => panic!("expected a manifest error, got {other:?}"),
    }
}

#[test]
fn every_stage_and_rank_holds_the_manifest() {
    let manifest = hybrid_manifest();
    for pp in 1..=4 {
        for tp in 1..=8 {
            for (s, stage) in stages(pp).into_iter().enumerate() {
                for rank in [0, tp - 1] {
                    let layout = hybrid(
                        stage.clone(),
                        (s as u32, pp),
                        (rank, tp),
                        &[],
                        None,
                        2_097_152,
                    );
                    check_manifest(&layout, &manifest, Some(stage.clone())).unwrap();
                }
            }
        }
    }
}

#[test]
fn a_state_pool_never_registered_is_refused_naming_each_tensor() {
    let linear: Vec<i64> = (0..LAYERS).filter(|&l| !mla_layer(l)).collect();
    let layout = hybrid(
        0..LAYERS,
        (0, 1),
        (0, 1),
        &["conv_q", "conv_k", "conv_v", "recurrent"],
        None,
        2_097_152,
    );
    let found = problems(check_manifest(&layout, &hybrid_manifest(), None));
    let want: Vec<_> = STATES
        .iter()
        .map(|(name, _)| ManifestProblem::Missing {
            role: (*name).into(),
            indexing: "state",
            layers: linear.clone(),
        })
        .collect();
    assert_eq!(found, want);
    let err = check_manifest(&layout, &hybrid_manifest(), None).unwrap_err();
    assert_eq!(err.kind(), "manifest");
    assert!(
        err.to_string().starts_with(
            "model hybrid: missing state component \"conv_q\" on layers 0-2, 4-6, 8-10, 12-14"
        ),
        "{err}"
    );
}

#[test]
fn any_one_missing_component_or_layer_is_named_exactly() {
    for (name, _) in STATES {
        let layout = hybrid(0..LAYERS, (0, 1), (0, 2), &[name], None, 2_097_152);
        let found = problems(check_manifest(&layout, &hybrid_manifest(), None));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(matches!(&found[0], ManifestProblem::Missing { role, .. } if role == name));
    }
    for drop in [0, 3, LAYERS - 1] {
        let layout = hybrid(0..LAYERS, (0, 1), (0, 1), &[], Some(drop), 2_097_152);
        for p in problems(check_manifest(&layout, &hybrid_manifest(), None)) {
            assert!(
                matches!(&p, ManifestProblem::Missing { layers, .. } if layers == &[drop]),
                "{p:?}"
            );
        }
    }
    // The stage's own last layer: only a given range can tell it is missing.
    let stage = stages(2)[0].clone();
    let last = stage.end - 1;
    let layout = hybrid(stage.clone(), (0, 2), (0, 1), &[], Some(last), 2_097_152);
    assert_eq!(
        problems(check_manifest(&layout, &hybrid_manifest(), None)),
        [ManifestProblem::StageRange {
            pp_rank: 0,
            pp_size: 2
        }]
    );
    assert!(!problems(check_manifest(&layout, &hybrid_manifest(), Some(stage))).is_empty());
}

#[test]
fn wrong_item_size_names_both_values_with_the_tp_share() {
    let layout = hybrid(0..LAYERS, (0, 1), (1, 4), &[], None, 1_048_576);
    let found = problems(check_manifest(&layout, &hybrid_manifest(), None));
    let [
        ManifestProblem::ItemSize {
            role,
            expected,
            got,
            why,
            ..
        },
    ] = found.as_slice()
    else {
        panic!("{found:?}");
    };
    assert_eq!(
        (role.as_str(), *expected, *got),
        ("recurrent", 524_288, 262_144)
    );
    assert!(why.contains("split over TP 4"), "{why}");
}

#[test]
fn mha_heads_and_windows_are_checked() {
    // Four layers, K and V of 8 heads × 64 × bf16, every even layer a 128-token window.
    let kv_heads = 8;
    let manifest = ModelManifest {
        model: "alt".into(),
        num_layers: 4,
        components: ["k", "v"]
            .into_iter()
            .flat_map(|role| {
                [(vec![0, 2], Some(128)), (vec![1, 3], None)]
                    .into_iter()
                    .map(move |(layers, window)| ManifestComponent {
                        window,
                        ..component(
                            role,
                            Indexing::Page,
                            layers,
                            1024,
                            Sharding::Heads { kv_heads },
                        )
                    })
            })
            .collect(),
    };
    let build = |tp: u32, windows: [Option<u64>; 4]| {
        let item = 1024 / u64::from(kv_heads) * u64::from(heads_per_rank_at(kv_heads, tp)) * PAGE;
        let ptrs = |base: u64| (0..4).map(|i| base + i * (1 << 20)).collect::<Vec<u64>>();
        let ctx = LayoutContext {
            page_size: PAGE,
            num_model_layers: Some(4),
            tp_size: tp,
            ..LayoutContext::default()
        };
        Layout::mha(
            ptrs(1 << 32),
            ptrs(1 << 33),
            vec![16 * item; 4],
            vec![16 * item; 4],
            vec![item; 4],
            vec![item; 4],
            Some(vec![0, 1, 2, 3]),
            ctx,
        )
        .unwrap()
        .with_windows(windows.iter().chain(&windows).copied().collect())
        .unwrap()
    };
    let alternating = [Some(128), None, Some(128), None];
    for tp in 1..=16 {
        check_manifest(&build(tp, alternating), &manifest, None).unwrap();
    }
    let found = problems(check_manifest(&build(2, [None; 4]), &manifest, None));
    assert_eq!(
        found,
        ["k", "v"].map(|role| ManifestProblem::Shape {
            role: role.into(),
            layers: vec![0, 2],
            what: "window",
            expected: Some(128),
            got: None
        })
    );
}

#[test]
fn another_models_manifest_is_refused() {
    let mut other = hybrid_manifest();
    other.model = "other".into();
    other.num_layers = 20;
    for c in &mut other.components {
        c.role = format!("x_{}", c.role);
    }
    let layout = hybrid(0..LAYERS, (0, 1), (0, 1), &[], None, 2_097_152);
    let found = problems(check_manifest(&layout, &other, Some(0..LAYERS)));
    assert_eq!(
        found[0],
        ManifestProblem::ModelLayers {
            manifest: 20,
            layout: 16
        }
    );
    let kinds: Vec<_> = found.iter().map(ManifestProblem::kind).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "missing").count(), 5);
    assert_eq!(kinds.iter().filter(|k| **k == "unexpected").count(), 5);
}

#[test]
fn malformed_manifests_and_layer_ranges() {
    let mut bad = hybrid_manifest();
    bad.components[0].bytes = 0;
    bad.components[1].layers.push(99);
    bad.components.push(component(
        "k",
        Indexing::Page,
        vec![0],
        1000,
        Sharding::Heads { kv_heads: 3 },
    ));
    let layout = hybrid(0..LAYERS, (0, 1), (0, 1), &[], None, 2_097_152);
    let found = problems(check_manifest(&layout, &bad, None));
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(found.iter().all(|p| p.kind() == "malformed"));
    assert_eq!(layer_ranges(&[0, 1, 2, 4, 5, 6, 8]), "0-2, 4-6, 8");
    assert_eq!(layer_ranges(&[3, 7, 11, 15, 16]), "3-15 step 4, 16");
    assert_eq!(layer_ranges(&[1, 5]), "1, 5");
    assert_eq!(layer_ranges(&[]), "");
}
