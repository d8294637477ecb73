//! Plans one request between a prefill peer and a decode peer and prints its blocks.
//!
//! Each peer registers two layers of K and V buffers (an MHA model, 16 tokens per page); the
//! decode registered its layers in the other order, so entries pair by layer id, not position.
//! Pages 3-4 go to 10-11 (one run) and page 9 to page 2: 2 runs x 4 entries = 8 blocks.
//!
//! ```text
//! cargo run -p kvplan-core --example plan_request
//! ```
//!
//! `cargo test -p kvplan-core --example plan_request` runs the test below, which checks what
//! the example prints.

use kvplan_core::{Layout, LayoutContext, PlanError, Request, Template, TemplateOptions};

const PAGES: u64 = 64;
const K_ITEM: u64 = 2048; // 16 tokens x 8 heads x 8 bytes per head
const V_ITEM: u64 = 1024;

/// One peer's layers `layers` (K and V buffers each), the buffers 1 GiB apart from `base`.
fn peer(base: u64, layers: &[i64]) -> Result<Layout, PlanError> {
    let n = layers.len() as u64;
    let k_ptrs = (0..n).map(|i| base + i * (1 << 30)).collect();
    let v_ptrs = (0..n).map(|i| base + (n + i) * (1 << 30)).collect();
    let context = LayoutContext {
        page_size: 16,
        ..LayoutContext::default()
    };
    Layout::mha(
        k_ptrs,
        v_ptrs,
        vec![K_ITEM * PAGES; layers.len()],
        vec![V_ITEM * PAGES; layers.len()],
        vec![K_ITEM; layers.len()],
        vec![V_ITEM; layers.len()],
        Some(layers.to_vec()),
        context,
    )
}

/// The plan's blocks as printed lines: `src -> dst, length`.
fn plan_lines() -> Result<Vec<String>, PlanError> {
    let prefill = peer(1 << 40, &[0, 1])?;
    let decode = peer(1 << 44, &[1, 0])?;
    let template = Template::new(&prefill, &decode, TemplateOptions::default())?;
    let plan = template.plan(&Request::pages(&[3i64, 4, 9], &[10i64, 11, 2]))?;
    Ok((0..plan.lengths.len())
        .map(|i| {
            format!(
                "{:#014x} -> {:#014x}, {:>5} bytes",
                plan.src_addrs[i], plan.dst_addrs[i], plan.lengths[i]
            )
        })
        .collect())
}

fn main() -> Result<(), PlanError> {
    let lines = plan_lines()?;
    println!("{} blocks:", lines.len());
    for line in lines {
        println!("  {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_two_runs_per_entry() {
        let lines = plan_lines().unwrap();
        assert_eq!(lines.len(), 8);
        // The first block: prefill K of layer 0, pages 3-4, to the decode's K of layer 0,
        // which it registered second (1 GiB after its base), pages 10-11.
        let first = format!(
            "{:#014x} -> {:#014x}, {:>5} bytes",
            (1u64 << 40) + 3 * K_ITEM,
            (1u64 << 44) + (1 << 30) + 10 * K_ITEM,
            2 * K_ITEM
        );
        assert_eq!(lines[0], first);
    }
}
