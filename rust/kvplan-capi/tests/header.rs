//! The checked-in header is what cbindgen generates from the current source.
//! `KVPLAN_BLESS=1 cargo test -p kvplan-capi --test header` rewrites it.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_src(dir.join("src/lib.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = dir.join("include/kvplan.h");
    if std::env::var_os("KVPLAN_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/kvplan.h");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/kvplan.h is not what cbindgen generates from src/lib.rs; regenerate it with \
         KVPLAN_BLESS=1 cargo test -p kvplan-capi --test header\n--- generated:\n{}",
        String::from_utf8_lossy(&generated)
    );
}
