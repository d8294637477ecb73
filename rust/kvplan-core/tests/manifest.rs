//! Model manifests ([`check_manifest`]): a hybrid model's layouts (MLA on every 4th layer, four
//! state tensors on the others; an MHA model with alternating window layers) hold their manifest
//! at every PP split and TP size, and a layout missing any one component, with another item
//! size or window, or of another model is refused naming exactly that.

use kvplan_core::{
    Fusion, Indexing, Layout, LayoutContext, ManifestComponent, ManifestProblem, ModelManifest,
    Packed, PlanError, Sharding, check_manifest, heads_per_rank_at, layer_ranges,
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
        fusions: Vec::new(),
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
        layout = add_state(
            layout,
            name,
            slot,
            &linear,
            (2 << 32) + (k as u64) * (1 << 30),
        );
    }
    layout
}

/// `layout` with a state entry `name` of `slot` bytes (4 slots) on each of the `linear` layers,
/// its tensors from `base` on.
fn add_state(layout: Layout, name: &str, slot: u64, linear: &[i64], base: u64) -> Layout {
    let ptrs = (0..linear.len() as u64)
        .map(|i| base + i * (1 << 24))
        .collect();
    layout
        .with_state(
            name,
            ptrs,
            vec![4 * slot; linear.len()],
            vec![slot; linear.len()],
            linear.to_vec(),
        )
        .unwrap()
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
        fusions: Vec::new(),
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

/// The hybrid manifest with its conv states declared as one fused `conv` entry too, and its
/// recurrent state as `temporal` (one part renamed), as an engine holding two tensors per
/// linear layer publishes them.
fn fused_manifest() -> ModelManifest {
    let mut manifest = hybrid_manifest();
    manifest.fusions = vec![
        Fusion {
            role: "conv".into(),
            parts: vec!["conv_q".into(), "conv_k".into(), "conv_v".into()],
        },
        Fusion {
            role: "temporal".into(),
            parts: vec!["recurrent".into()],
        },
    ];
    manifest
}

/// One rank's layout of the whole model holding the MLA latent and the state tensors `states`
/// (role, bytes at TP 1) on every linear layer.
fn with_states(states: &[(&str, u64)], tp: (u32, u32)) -> Layout {
    let mut layout = hybrid(
        0..LAYERS,
        (0, 1),
        tp,
        &["conv_q", "conv_k", "conv_v", "recurrent"],
        None,
        0,
    );
    let linear: Vec<i64> = (0..LAYERS).filter(|&l| !mla_layer(l)).collect();
    for (k, (name, bytes)) in states.iter().enumerate() {
        let slot = bytes / u64::from(tp.1);
        layout = add_state(
            layout,
            name,
            slot,
            &linear,
            (3 << 32) + (k as u64) * (1 << 30),
        );
    }
    layout
}

fn linear_layers() -> Vec<i64> {
    (0..LAYERS).filter(|&l| !mla_layer(l)).collect()
}

fn notes(result: kvplan_core::Result<()>) -> (Vec<ManifestProblem>, Vec<String>) {
    match result {
        Err(PlanError::Manifest {
            problems, notes, ..
        }) => (problems, notes),
        other => panic!("expected a manifest error, got {other:?}"),
    }
}

const CONV: u64 = 3 * 24_576;

#[test]
fn a_fusion_takes_the_fused_form_or_the_parts_at_every_tp() {
    let manifest = fused_manifest();
    for tp in [1, 2, 4, 8] {
        for rank in [0, tp - 1] {
            // The parts, as the manifest's components name them.
            let parts = hybrid(0..LAYERS, (0, 1), (rank, tp), &[], None, 2_097_152);
            check_manifest(&parts, &manifest, None).unwrap();
            // One conv entry over the three, the recurrent state renamed.
            let fused = with_states(&[("conv", CONV), ("temporal", 2_097_152)], (rank, tp));
            check_manifest(&fused, &manifest, None).unwrap();
            // Each fusion on its own.
            let conv_only = with_states(&[("conv", CONV), ("recurrent", 2_097_152)], (rank, tp));
            check_manifest(&conv_only, &manifest, None).unwrap();
        }
    }
    // Without the fusions the fused form is four components missing and two unexpected.
    let fused = with_states(&[("conv", CONV), ("temporal", 2_097_152)], (0, 1));
    let found = problems(check_manifest(&fused, &hybrid_manifest(), None));
    let kinds: Vec<_> = found.iter().map(ManifestProblem::kind).collect();
    assert_eq!(
        kinds,
        [
            "missing",
            "missing",
            "missing",
            "missing",
            "unexpected",
            "unexpected"
        ]
    );
}

#[test]
fn a_fused_entry_and_a_part_beside_it_are_refused_naming_the_part() {
    let layout = with_states(
        &[("conv", CONV), ("conv_q", 24_576), ("recurrent", 2_097_152)],
        (0, 2),
    );
    let (found, notes) = notes(check_manifest(&layout, &fused_manifest(), None));
    assert_eq!(
        found,
        [ManifestProblem::Unexpected {
            role: "conv_q".into(),
            indexing: "state",
            layers: linear_layers(),
        }]
    );
    assert_eq!(
        notes,
        [
            "this layout holds conv_q beside the one 'conv' entry that holds conv_q, conv_k, \
          conv_v: a layout holds either the one entry or its parts, never both"
        ]
    );
    let err = check_manifest(&layout, &fused_manifest(), None).unwrap_err();
    assert!(
        err.to_string().starts_with(
            "model hybrid: state entries \"conv_q\" on layers 0-2, 4-6, 8-10, 12-14 are not in \
             the manifest (this layout holds conv_q beside"
        ),
        "{err}"
    );
}

#[test]
fn only_some_parts_are_refused_naming_the_missing_ones_and_the_fused_entry() {
    let layout = with_states(
        &[
            ("conv_q", 24_576),
            ("conv_v", 24_576),
            ("recurrent", 2_097_152),
        ],
        (1, 2),
    );
    let (found, notes) = notes(check_manifest(&layout, &fused_manifest(), None));
    assert_eq!(
        found,
        [ManifestProblem::Missing {
            role: "conv_k".into(),
            indexing: "state",
            layers: linear_layers(),
        }]
    );
    assert_eq!(
        notes,
        [
            "conv_q, conv_k, conv_v may also be held as one 'conv' entry per layer, of which this \
          layout has none"
        ]
    );
}

#[test]
fn a_missing_fused_or_renamed_entry_is_refused_naming_the_parts() {
    // The fused conv held, the recurrent state in neither form.
    let layout = with_states(&[("conv", CONV)], (0, 1));
    let (found, notes) = notes(check_manifest(&layout, &fused_manifest(), None));
    assert_eq!(
        found,
        [ManifestProblem::Missing {
            role: "recurrent".into(),
            indexing: "state",
            layers: linear_layers(),
        }]
    );
    assert_eq!(
        notes,
        ["recurrent may also be held as 'temporal', of which this layout has none"]
    );
    // The fused entry of the wrong size: checked as the one fused component.
    let layout = with_states(&[("conv", 2 * 24_576), ("temporal", 2_097_152)], (0, 2));
    let found = problems(check_manifest(&layout, &fused_manifest(), None));
    assert!(
        matches!(found.as_slice(), [ManifestProblem::ItemSize { role, expected, got, .. }]
            if role == "conv" && *expected == CONV / 2 && *got == 24_576),
        "{found:?}"
    );
}

#[test]
fn a_fusion_whose_parts_cannot_merge_is_refused_when_taken_and_malformed_ones_always() {
    let mut manifest = fused_manifest();
    manifest.components[1].sharding = Sharding::Replicated; // conv_q
    let fused = with_states(&[("conv", CONV), ("temporal", 2_097_152)], (0, 1));
    let err = check_manifest(&fused, &manifest, None).unwrap_err();
    assert!(
        err.to_string().contains(
            "cannot pack conv_q, conv_k, conv_v into one 'conv' entry per layer: layers 0-2, \
             4-6, 8-10, 12-14 the parts differ in sharding (conv_q 'replicated', conv_k \
             'split', conv_v 'split')"
        ),
        "{err}"
    );
    // Not taken: the parts are checked as they are (at TP 1 a replicated conv_q holds what a
    // split one does).
    check_manifest(&parts_layout(), &manifest, None).unwrap();
    for parts in [
        vec![],
        vec!["a".to_owned(), "a".to_owned()],
        vec!["conv".to_owned()],
    ] {
        let mut bad = fused_manifest();
        bad.fusions[0].parts = parts;
        let found = problems(check_manifest(&parts_layout(), &bad, None));
        assert!(
            matches!(found.as_slice(), [ManifestProblem::Malformed { what }]
                if what.contains("needs a role and one or more distinct part roles")),
            "{found:?}"
        );
    }
}

fn parts_layout() -> Layout {
    hybrid(0..LAYERS, (0, 1), (0, 1), &[], None, 2_097_152)
}

#[test]
fn packed_merges_parts_per_layer_group_and_keeps_the_rest_in_place() {
    let manifest = fused_manifest();
    let conv: Vec<String> = ["conv_q", "conv_k", "conv_v"].map(String::from).to_vec();
    let packed = manifest.pack("conv", &conv).unwrap();
    assert_eq!(packed[0], Packed::Kept(0));
    let Packed::Merged(merged) = &packed[1] else {
        panic!("{packed:?}")
    };
    assert_eq!(
        (merged.role.as_str(), merged.bytes, &merged.layers),
        ("conv", CONV, &linear_layers())
    );
    assert_eq!(packed[2], Packed::Kept(4));
    assert_eq!(packed.len(), 3);
    // A manifest without the parts is unchanged; a layer holding some parts is refused.
    assert_eq!(manifest.packed("kv2", &["x".to_owned()]).unwrap(), manifest);
    let mut some = manifest.clone();
    some.components[2].layers.retain(|&l| l != 0);
    let err = some.packed("conv", &conv).unwrap_err();
    assert!(
        err.to_string()
            .contains("layers 0 hold conv_q, conv_v, not one each of conv_q, conv_k, conv_v"),
        "{err}"
    );
}
