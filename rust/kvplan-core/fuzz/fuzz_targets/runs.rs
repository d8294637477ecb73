//! group_contiguous: any int32/int64 inputs; runs equal a naive reference, pages conserved,
//! rejections only for unequal lengths or a negative index.
#![no_main]
use arbitrary::Arbitrary;
use kvplan_core_fuzz::{Indices, check_runs};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    src: Vec<i64>,
    dst: Vec<i64>,
    src_narrow: bool,
    dst_narrow: bool,
    /// Turn the values into mostly-contiguous sequences so long runs are exercised.
    runs: bool,
}

fn shape(values: &[i64], runs: bool, narrow: bool) -> Indices {
    let v: Vec<i64> = if runs {
        let mut cur = 0i64;
        values
            .iter()
            .map(|&x| {
                cur = if x % 7 == 0 { x } else { cur.wrapping_add(1) };
                cur
            })
            .collect()
    } else {
        values.to_vec()
    };
    if narrow {
        Indices::I32(v.into_iter().map(|x| x as i32).collect())
    } else {
        Indices::I64(v)
    }
}

fuzz_target!(|input: Input| {
    let n = input.src.len().min(input.dst.len());
    // Mostly equal lengths (the interesting case), sometimes not.
    let (src, dst) = if input.src.len() % 5 == 0 {
        (&input.src[..], &input.dst[..])
    } else {
        (&input.src[..n], &input.dst[..n])
    };
    check_runs(
        &shape(src, input.runs, input.src_narrow),
        &shape(dst, input.runs, input.dst_narrow),
    );
});
