//! The module layers written in the crate docs (`src/lib.rs`) hold: every folder and every
//! module in it is listed once, every `crate::` path in a module's code (doc comments aside)
//! names a module of a layer above its own (an earlier folder, or an earlier layer of its own
//! folder), and docs/design.md's table of the core's modules is the one these files generate.
//! A module may itself be a folder of parts (`peer/layout/mod.rs` and the files it declares):
//! the parts are one module, so their `crate::` uses are the module's and a part's `super::`
//! names the module itself.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

const START: &str = "<!-- module layers -->";
const END: &str = "<!-- end module layers -->";
const TABLE_START: &str = "<!-- core modules: generated";
const TABLE_END: &str = "<!-- end core modules -->";
const BLESS: &str = "KVPLAN_BLESS=1 cargo test -p kvplan-core --test module_layers";

/// Where a module sits: (folder or root-module layer, layer inside its folder; 0 at the root).
type Rank = (usize, usize);

/// What the numbered list between the markers states.
#[derive(Debug, Default)]
struct Layers {
    /// Module path (`error`, `rules::check`) -> its rank.
    ranks: BTreeMap<String, Rank>,
    /// Folder name -> its layer number.
    folders: BTreeMap<String, usize>,
    /// Folders and modules in the order written (`peer/`, `peer::kv_format`, ...).
    order: Vec<String>,
}

fn is_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
}

/// The item number a list line starts with, and whether the line is nested in a folder.
fn item_number(text: &str) -> Option<(usize, bool)> {
    let body = text.trim_start();
    let indent = text.len() - body.len();
    let (number, _) = body.split_once(". ")?;
    let n = number.parse::<usize>().ok()?;
    Some((n, indent > 1))
}

/// The folders and modules of the numbered list between the markers: a top-level item is a
/// root module (`error`) or a folder (`peer/`); the items nested under a folder are its layers.
fn written_layers(lib: &str) -> Layers {
    let block = lib
        .split(START)
        .nth(1)
        .and_then(|rest| rest.split(END).next())
        .expect("the module layer markers in src/lib.rs");
    let mut layers = Layers::default();
    let mut top = 0;
    let mut sub = 0;
    let mut folder: Option<String> = None;
    for line in block.lines() {
        let text = line.strip_prefix("//!").unwrap_or(line);
        if let Some((n, nested)) = item_number(text) {
            if nested {
                assert!(
                    folder.is_some(),
                    "layer {n} nested under no folder: {text:?}"
                );
                sub = n;
            } else {
                top = n;
                sub = 0;
                folder = None;
            }
        }
        // A name is in backticks right at the start of an item or after "), ".
        let text = text.trim();
        let mut rest = text;
        while let Some(open) = rest.find('`') {
            let after = &rest[open + 1..];
            let Some(close) = after.find('`') else { break };
            let name = &after[..close];
            let before = rest[..open].trim_end();
            let lists_a_name = before.is_empty()
                || before.ends_with("),")
                || before.ends_with('.') && before.chars().all(|c| c.is_ascii_digit() || c == '.');
            rest = &after[close + 1..];
            if !lists_a_name {
                continue;
            }
            assert!(top > 0, "`{name}` listed before any layer number");
            if let Some(folder_name) = name.strip_suffix('/') {
                assert!(is_name(folder_name), "folder `{name}` is not a module name");
                assert!(sub == 0, "folder `{name}` nested in another folder");
                let previous = layers.folders.insert(folder_name.to_string(), top);
                assert!(previous.is_none(), "folder `{name}` listed twice");
                folder = Some(folder_name.to_string());
                layers.order.push(name.to_string());
            } else if is_name(name) {
                let path = match (&folder, sub) {
                    (Some(f), s) if s > 0 => format!("{f}::{name}"),
                    (Some(f), _) => panic!("module `{name}` in folder `{f}/` outside its layers"),
                    (None, _) => name.to_string(),
                };
                let previous = layers.ranks.insert(path.clone(), (top, sub));
                assert!(previous.is_none(), "module `{path}` listed twice");
                layers.order.push(path);
            }
        }
    }
    layers
}

/// The modules a source file's code names as `crate::<module>` or
/// `crate::<folder>::<module>`, doc comments left out. A path the layers cannot place (a
/// grouped `crate::{..}`, a root re-export, a bare folder, a `super::` path other than the test
/// modules' `use super::*`) comes back as itself, so the test reports it.
fn crate_uses(source: &str, folders: &BTreeMap<String, usize>) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut used = Vec::new();
    for line in source.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + 7..];
            let first = ident(after);
            let path = if folders.contains_key(&first) {
                let tail = &after[first.len()..];
                match tail.strip_prefix("::").map(ident) {
                    Some(module) if is_name(&module) => format!("{first}::{module}"),
                    _ => format!("crate::{first}{}", tail.chars().take(3).collect::<String>()),
                }
            } else if is_name(&first) {
                first
            } else {
                format!(
                    "crate::{}",
                    after.chars().take(first.len().max(1)).collect::<String>()
                )
            };
            used.push(path);
            rest = after;
        }
        let mut rest = code;
        while let Some(at) = rest.find("super::") {
            let after = &rest[at + 7..];
            if !after.starts_with('*') {
                used.push(format!("super::{}", ident(after)));
            }
            rest = after;
        }
    }
    used
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn declared_mods(file: &Path) -> Vec<String> {
    fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';').to_string())
        .collect()
}

/// The parts a module folder's `mod.rs` declares (`mod build;`, `#[cfg(test)] mod tests;`).
fn declared_parts(file: &Path) -> Vec<String> {
    fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

/// The `.rs` files in `dir` but `mod.rs`, by name without the extension, sorted.
fn rs_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|f| f.strip_suffix(".rs").map(str::to_string))
        .filter(|f| f != "mod")
        .collect();
    names.sort();
    names
}

/// The parts of module `module` whose main file is `file`: none for a `<module>.rs`, and for
/// a module folder (`<module>/mod.rs`) the files its `mod.rs` declares, which must be exactly
/// the `.rs` files beside it, in the order declared.
fn module_parts(module: &str, file: &Path) -> Vec<(String, PathBuf)> {
    if file.file_name().is_none_or(|f| f != "mod.rs") {
        return Vec::new();
    }
    let dir = file.parent().unwrap();
    let declared = declared_parts(file);
    let mut sorted = declared.clone();
    sorted.sort();
    assert_eq!(
        rs_files(dir),
        sorted,
        "the mod.rs of module {module} and the files beside it differ"
    );
    declared
        .into_iter()
        .map(|part| {
            let path = dir.join(format!("{part}.rs"));
            (format!("{module}::{part}"), path)
        })
        .collect()
}

/// Every module on disk: its path (`error`, `rules::check`) and main file. A folder is a
/// directory with a `mod.rs` that declares exactly the `.rs` files and module folders beside
/// it; a module in a folder is a `<module>.rs` or a module folder `<module>/mod.rs`.
fn modules_on_disk(layers: &Layers) -> (Vec<String>, BTreeMap<String, PathBuf>) {
    let src = src();
    let mut folders = Vec::new();
    let mut files = BTreeMap::new();
    for name in declared_mods(&src.join("lib.rs")) {
        let dir = src.join(&name);
        if dir.is_dir() {
            let mut on_disk = rs_files(&dir);
            on_disk.extend(
                fs::read_dir(&dir)
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .filter(|p| p.join("mod.rs").is_file())
                    .map(|p| p.file_name().unwrap().to_str().unwrap().to_string()),
            );
            on_disk.sort();
            let mut declared = declared_mods(&dir.join("mod.rs"));
            declared.sort();
            assert_eq!(
                on_disk, declared,
                "src/{name}/mod.rs and the files in src/{name}/ differ"
            );
            for module in declared {
                let single = dir.join(format!("{module}.rs"));
                let file = if single.is_file() {
                    single
                } else {
                    dir.join(&module).join("mod.rs")
                };
                files.insert(format!("{name}::{module}"), file);
            }
            folders.push(name);
        } else {
            files.insert(name.clone(), src.join(format!("{name}.rs")));
        }
    }
    folders.sort();
    let mut listed_folders: Vec<String> = layers.folders.keys().cloned().collect();
    listed_folders.sort();
    assert_eq!(
        listed_folders, folders,
        "the folders in the layer list and the folders under src/ differ"
    );
    (folders, files)
}

#[test]
fn every_module_uses_only_layers_above_its_own() {
    let lib = fs::read_to_string(src().join("lib.rs")).unwrap();
    let layers = written_layers(&lib);
    let (_, files) = modules_on_disk(&layers);
    let listed: Vec<&String> = layers.ranks.keys().collect();
    let on_disk: Vec<&String> = files.keys().collect();
    assert_eq!(
        listed, on_disk,
        "the layer list and the modules under src/ differ"
    );

    let mut breaks = Vec::new();
    for (module, file) in &files {
        let own = layers.ranks[module];
        let mut uses = crate_uses(&fs::read_to_string(file).unwrap(), &layers.folders);
        for (_, part) in module_parts(module, file) {
            let source = fs::read_to_string(part).unwrap();
            // A part's `super::` is its own module; `super::super` is a folder, reported.
            uses.extend(
                crate_uses(&source, &layers.folders)
                    .into_iter()
                    .filter(|u| !u.starts_with("super::") || u.starts_with("super::super")),
            );
        }
        for used in uses {
            if used == *module {
                continue;
            }
            match layers.ranks.get(&used) {
                Some(&theirs) if theirs < own => {}
                Some(&theirs) => breaks.push(format!(
                    "{module} (layer {own:?}) uses {used} (layer {theirs:?})"
                )),
                None => breaks.push(format!(
                    "{module} uses {used}, which is no listed module (write `crate::<folder>::<module>::..` paths)"
                )),
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
    // The reader and the scan are what the test above relies on: a use of a lower layer, in a
    // folder or across folders, must be found, and a path it cannot place must come back.
    let lib = "//! <!-- module layers -->\n//! 1. `error` (e).\n//! 2. `peer/` (p):\n\
               //!    1. `kv_format` (k).\n//!    2. `layout` (x), `runs` (y).\n\
               //! 3. `rules/` (r):\n//!    1. `check` (c).\n\
               //! <!-- end module layers -->\n";
    let layers = written_layers(lib);
    assert_eq!(layers.ranks["error"], (1, 0));
    assert_eq!(layers.ranks["peer::kv_format"], (2, 1));
    assert_eq!(layers.ranks["peer::layout"], (2, 2));
    assert_eq!(layers.ranks["peer::runs"], (2, 2));
    assert_eq!(layers.ranks["rules::check"], (3, 1));
    assert_eq!(layers.folders["peer"], 2);
    // Up a folder (check before layout is fine; layout using check runs back up) and up a
    // layer inside a folder both rank higher than the user.
    assert!(layers.ranks["rules::check"] > layers.ranks["peer::layout"]);
    assert!(layers.ranks["peer::layout"] > layers.ranks["peer::kv_format"]);
    assert!(layers.ranks["peer::layout"] > layers.ranks["error"]);
    assert_eq!(
        crate_uses(
            "use crate::peer::runs::scan;\n//! [`crate::rules::check`]\nlet x = crate::error::E;\n\
             use crate::{error, peer};\nlet t = crate::Template;\nuse crate::rules::{check};\n\
             use super::*;\nuse super::layout::L;",
            &layers.folders
        ),
        [
            "peer::runs",
            "error",
            "crate::{",
            "crate::Template",
            "crate::rules::{",
            "super::layout"
        ]
        .map(String::from)
    );
}

/// A module's summary: the first sentence of its first doc paragraph.
fn first_sentence(source: &str) -> String {
    let mut paragraph = String::new();
    for line in source.lines() {
        let Some(text) = line.strip_prefix("//!") else {
            break;
        };
        let text = text.trim();
        if text.is_empty() {
            break;
        }
        if !paragraph.is_empty() {
            paragraph.push(' ');
        }
        paragraph.push_str(text);
    }
    // A sentence ends at a period outside parentheses and code, before a capital letter.
    let (mut depth, mut code) = (0i32, false);
    let chars: Vec<(usize, char)> = paragraph.char_indices().collect();
    for (k, &(at, c)) in chars.iter().enumerate() {
        match c {
            '`' => code = !code,
            '(' if !code => depth += 1,
            ')' if !code => depth -= 1,
            '.' if !code && depth == 0 => {
                let next = chars.get(k + 1).map(|&(_, c)| c);
                let after = chars.get(k + 2).map(|&(_, c)| c);
                if next == Some(' ') && after.is_some_and(char::is_uppercase) {
                    return paragraph[..=at].to_string();
                }
            }
            _ => {}
        }
    }
    paragraph
}

/// A summary as markdown table text: intra-doc links read as plain code.
fn table_text(summary: &str) -> String {
    summary
        .replace("[`", "`")
        .replace("`]", "`")
        .replace('|', "\\|")
}

/// docs/design.md's table of the core's modules, as the modules' docs state it: one row per
/// folder and module in the order of the layer list, a module folder's parts after it in the
/// order its `mod.rs` declares them.
fn module_table() -> String {
    let lib = fs::read_to_string(src().join("lib.rs")).unwrap();
    let layers = written_layers(&lib);
    let (_, files) = modules_on_disk(&layers);
    let mut table =
        String::from("| module | what it is (its first doc sentence) |\n| --- | --- |\n");
    for item in &layers.order {
        let (name, file) = match item.strip_suffix('/') {
            Some(folder) => (
                format!("**`{folder}/`**"),
                src().join(folder).join("mod.rs"),
            ),
            None => (format!("`{item}`"), files[item].clone()),
        };
        let summary = first_sentence(&fs::read_to_string(file).unwrap());
        writeln!(table, "| {name} | {} |", table_text(&summary)).unwrap();
        let module = item.strip_suffix('/').map_or(item.as_str(), |_| "");
        let parts = files
            .get(module)
            .map(|file| module_parts(module, file))
            .unwrap_or_default();
        for (part, file) in parts {
            let summary = first_sentence(&fs::read_to_string(file).unwrap());
            writeln!(table, "| ↳ `{part}` | {} |", table_text(&summary)).unwrap();
        }
    }
    table
}

#[test]
fn the_design_doc_module_table_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/design.md");
    let doc = fs::read_to_string(&path).unwrap();
    let start = doc
        .find(TABLE_START)
        .expect("the core module table markers in docs/design.md");
    let body = start
        + doc[start..]
            .find("-->\n")
            .expect("the end of the start marker")
        + 4;
    let end = doc
        .find(TABLE_END)
        .expect("the end marker of the core module table");
    let generated = module_table();
    if doc[body..end] == generated {
        return;
    }
    if std::env::var_os("KVPLAN_BLESS").is_some_and(|v| v == "1") {
        fs::write(&path, format!("{}{generated}{}", &doc[..body], &doc[end..])).unwrap();
        return;
    }
    panic!(
        "docs/design.md's core module table is not the modules' first doc sentences in the \
         order of src/lib.rs's layer list; regenerate it with {BLESS}\n--- generated:\n{generated}"
    );
}

#[test]
fn a_summary_is_the_first_sentence_of_the_first_paragraph() {
    assert_eq!(
        first_sentence("//! One thing: it (e.g. `a.b`). More\n//! text.\n//!\n//! Later."),
        "One thing: it (e.g. `a.b`)."
    );
    assert_eq!(
        first_sentence("//! Ring state\n//! between rings.\n"),
        "Ring state between rings."
    );
}
