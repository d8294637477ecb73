//! The bindings' modules import one another without a circle: every `crate::<module>` path
//! in a module's code (comments left out) is an edge from that module to the one it names,
//! and the graph of those edges has no cycle. A failure names each circle found.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The modules `src/lib.rs` declares (`mod name;`), in order.
fn declared_modules(lib: &str) -> Vec<String> {
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("pub(crate) mod "))
                .or_else(|| l.strip_prefix("mod "))
        })
        .filter_map(|l| l.strip_suffix(';'))
        .map(str::to_string)
        .collect()
}

/// The source with every `//` comment (doc comments included) cut off its line.
fn code_only(source: &str) -> String {
    source
        .lines()
        .map(|line| line.split_once("//").map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

fn leading_name(text: &str) -> String {
    text.trim_start()
        .chars()
        .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
        .collect()
}

/// The modules a source file's code names as `crate::<module>` or in `crate::{a, b::c}`.
fn crate_uses(source: &str) -> BTreeSet<String> {
    let code = code_only(source);
    let mut used = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the braced list only: `a::{x, y}` names `a`.
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        used.insert(leading_name(&group[start..i]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        used.insert(leading_name(&group[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            used.insert(leading_name(rest));
        }
    }
    used.remove("");
    used
}

/// Every circle in `edges`, each written `a -> b -> a`, found as the back edges of a
/// depth-first walk from each module in turn (so each circle is reported once per back edge).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        OnPath,
        Done,
    }
    fn walk(
        module: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
        found: &mut Vec<String>,
    ) {
        marks.insert(module.to_string(), Mark::OnPath);
        path.push(module.to_string());
        for next in edges.get(module).into_iter().flatten() {
            match marks.get(next).copied().unwrap_or(Mark::New) {
                Mark::New => walk(next, edges, marks, path, found),
                Mark::OnPath => {
                    let from = path.iter().position(|m| m == next).unwrap();
                    let mut circle = path[from..].to_vec();
                    circle.push(next.clone());
                    found.push(circle.join(" -> "));
                }
                Mark::Done => {}
            }
        }
        path.pop();
        marks.insert(module.to_string(), Mark::Done);
    }
    let mut marks = BTreeMap::new();
    let mut found = Vec::new();
    for module in edges.keys() {
        if marks.get(module).copied().unwrap_or(Mark::New) == Mark::New {
            walk(module, edges, &mut marks, &mut Vec::new(), &mut found);
        }
    }
    found
}

#[test]
fn the_bindings_modules_form_no_import_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    let modules = declared_modules(&lib);
    assert!(
        modules.len() > 10,
        "read the modules of src/lib.rs: {modules:?}"
    );
    let mut edges = BTreeMap::new();
    let mut unknown = Vec::new();
    for module in &modules {
        let source = fs::read_to_string(src.join(format!("{module}.rs"))).unwrap();
        let mut uses = crate_uses(&source);
        uses.remove(module);
        for used in &uses {
            if !modules.contains(used) {
                unknown.push(format!(
                    "{module} uses crate::{used}, not a module of lib.rs"
                ));
            }
        }
        edges.insert(module.clone(), uses);
    }
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
    let found = circles(&edges);
    assert!(
        found.is_empty(),
        "import circles between the bindings' modules:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_circle_finder_sees_a_circle() {
    // The scan and the walk are what the test above relies on.
    assert_eq!(
        declared_modules("mod a;\npub mod b;\n#[pyo3::pymodule]\nmod _core {\n"),
        vec!["a".to_string(), "b".to_string()]
    );
    let uses = crate_uses(
        "use crate::plan::{A, b};\n/// [`crate::doc`]\nlet x = crate::pool::take(1); // crate::note\n\
         use crate::{errors::{E, F}, options};\n",
    );
    let uses: Vec<&str> = uses.iter().map(String::as_str).collect();
    assert_eq!(uses, ["errors", "options", "plan", "pool"]);
    let edge = |a: &str, bs: &[&str]| (a.to_string(), bs.iter().map(ToString::to_string).collect());
    let edges: BTreeMap<String, BTreeSet<String>> = [
        edge("pack", &["plan", "template"]),
        edge("plan", &["pool"]),
        edge("pool", &[]),
        edge("template", &["pack", "plan"]),
    ]
    .into_iter()
    .collect();
    assert_eq!(circles(&edges), ["pack -> template -> pack"]);
    let acyclic: BTreeMap<String, BTreeSet<String>> = [
        edge("pack", &["plan"]),
        edge("plan", &["pool"]),
        edge("pool", &[]),
        edge("template", &["pack", "plan"]),
    ]
    .into_iter()
    .collect();
    assert!(circles(&acyclic).is_empty());
}
