//! The module layers written in the crate docs (`src/lib.rs`) hold: every module is listed
//! once, and every `crate::` path in a module's code (doc comments aside) names a module of
//! a layer above its own.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

const START: &str = "<!-- module layers -->";
const END: &str = "<!-- end module layers -->";

/// Module name -> layer number, from the numbered list between the markers.
fn written_layers(lib: &str) -> BTreeMap<String, usize> {
    let block = lib
        .split(START)
        .nth(1)
        .and_then(|rest| rest.split(END).next())
        .expect("the module layer markers in src/lib.rs");
    let mut layers = BTreeMap::new();
    let mut layer = 0;
    for line in block.lines() {
        let text = line.trim_start_matches("//!").trim();
        if let Some((number, _)) = text.split_once(". ")
            && let Ok(n) = number.parse::<usize>()
        {
            layer = n;
        }
        // A module is a name in backticks right at the start of an item or after "), ".
        let mut rest = text;
        while let Some(open) = rest.find('`') {
            let after = &rest[open + 1..];
            let Some(close) = after.find('`') else { break };
            let name = &after[..close];
            let before = rest[..open].trim_end();
            let lists_a_module = before.is_empty()
                || before.ends_with("),")
                || before.ends_with('.') && before.chars().all(|c| c.is_ascii_digit() || c == '.');
            if lists_a_module && name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                assert!(layer > 0, "module `{name}` listed before any layer number");
                let previous = layers.insert(name.to_string(), layer);
                assert!(previous.is_none(), "module `{name}` listed twice");
            }
            rest = &after[close + 1..];
        }
    }
    layers
}

/// The modules a source file's code names as `crate::<module>`, doc comments left out.
fn crate_uses(source: &str) -> Vec<String> {
    let mut used = Vec::new();
    for line in source.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let name: String = rest[at + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() {
                used.push(name);
            }
            rest = &rest[at + 7..];
        }
    }
    used
}

#[test]
fn every_module_uses_only_layers_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    let layers = written_layers(&lib);
    let declared: Vec<String> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';').to_string())
        .collect();
    let mut listed: Vec<String> = layers.keys().cloned().collect();
    let mut sorted_declared = declared.clone();
    sorted_declared.sort();
    listed.sort();
    assert_eq!(
        listed, sorted_declared,
        "the layer list and the `pub mod` lines differ"
    );

    let mut breaks = Vec::new();
    for module in &declared {
        let source = fs::read_to_string(src.join(format!("{module}.rs"))).unwrap();
        let own = layers[module];
        for used in crate_uses(&source) {
            if used == *module {
                continue;
            }
            match layers.get(&used) {
                Some(&theirs) if theirs < own => {}
                Some(&theirs) => breaks.push(format!(
                    "{module} (layer {own}) uses {used} (layer {theirs})"
                )),
                None => breaks.push(format!("{module} uses unknown module {used}")),
            }
        }
    }
    breaks.sort();
    breaks.dedup();
    assert!(
        breaks.is_empty(),
        "module layers broken:\n{}",
        breaks.join("\n")
    );
}

#[test]
fn the_layer_reader_sees_a_break() {
    // The reader and the scan are what the test above relies on: a use of a lower layer
    // must be found.
    let lib = "//! <!-- module layers -->\n//! 1. `error`: e.\n//! 2. `layout` (x), `runs` (y).\n\
               //! <!-- end module layers -->\n";
    let layers = written_layers(lib);
    assert_eq!(layers["error"], 1);
    assert_eq!(layers["layout"], 2);
    assert_eq!(layers["runs"], 2);
    assert_eq!(
        crate_uses("use crate::runs::scan;\n//! [`crate::pack`]\nlet x = crate::error::E;"),
        vec!["runs".to_string(), "error".to_string()]
    );
}
