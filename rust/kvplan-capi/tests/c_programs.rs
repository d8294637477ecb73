//! The C++ example (examples/plan_copy.cpp) and the header, compiled with `-Wall -Wextra
//! -Werror` by every compiler found (g++ required; clang++ when installed) and the example run;
//! `tests/c/request2.c` (version 2 requests from C) and `tests/c/state_split.c` (a version 4
//! layout's TP channel split from C) built and run the same way with gcc / clang.

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The static library cargo built beside this test (target/<profile>/deps).
fn static_lib() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let lib = exe
        .parent()
        .expect("deps directory")
        .join("libkvplan_capi.a");
    assert!(lib.is_file(), "{} is missing", lib.display());
    lib
}

fn installed(compiler: &str) -> bool {
    Command::new(compiler)
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|err| panic!("{cmd:?}: {err}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn compilers(required: &str, optional: &str) -> Vec<&'static str> {
    let (required, optional): (&'static str, &'static str) =
        (Box::leak(required.into()), Box::leak(optional.into()));
    assert!(
        installed(required),
        "{required} is not installed (scripts/setup-env installs it)"
    );
    let mut found = vec![required];
    if installed(optional) {
        found.push(optional);
    } else {
        eprintln!("{optional} not installed: compiling with {required} only");
    }
    found
}

#[test]
fn cpp_example_builds_warning_free_and_moves_the_right_bytes() {
    let lib = static_lib();
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for compiler in compilers("g++", "clang++") {
        let exe = out_dir.join(format!("plan_copy-{compiler}"));
        run(Command::new(compiler)
            .args(["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("examples/plan_copy.cpp"))
            .arg(&lib)
            .args(["-lpthread", "-ldl", "-lm", "-o"])
            .arg(&exe));
        let printed = run(&mut Command::new(&exe));
        assert!(printed.contains("plan_copy: OK"), "{compiler}: {printed}");
    }
}

#[test]
fn header_compiles_as_strict_c11() {
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for compiler in compilers("gcc", "clang") {
        run(Command::new(compiler)
            .args([
                "-std=c11",
                "-pedantic",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-c",
                "-I",
            ])
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("tests/c/header_c11.c"))
            .arg("-o")
            .arg(out_dir.join(format!("header_c11-{compiler}.o"))));
    }
}

#[test]
fn version_2_requests_from_c() {
    let lib = static_lib();
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for compiler in compilers("gcc", "clang") {
        let exe = out_dir.join(format!("request2-{compiler}"));
        run(Command::new(compiler)
            .args(["-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("tests/c/request2.c"))
            .arg(&lib)
            .args(["-lpthread", "-ldl", "-lm", "-o"])
            .arg(&exe));
        let printed = run(&mut Command::new(&exe));
        assert!(printed.contains("request2: OK"), "{compiler}: {printed}");
    }
}

#[test]
fn version_4_state_split_from_c() {
    let lib = static_lib();
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for compiler in compilers("gcc", "clang") {
        let exe = out_dir.join(format!("state_split-{compiler}"));
        run(Command::new(compiler)
            .args(["-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("tests/c/state_split.c"))
            .arg(&lib)
            .args(["-lpthread", "-ldl", "-lm", "-o"])
            .arg(&exe));
        let printed = run(&mut Command::new(&exe));
        assert!(printed.contains("state_split: OK"), "{compiler}: {printed}");
    }
}
