//! `copy_local_threads` on several threads writes what one thread writes, byte for byte: random
//! plans over several source and destination buffers, blocks that overlap in the destination
//! (the later one in plan order wins), empty blocks, and a refused plan that copies nothing.

use kvplan_core::exchange::local::{
    MAX_DEFAULT_COPY_THREADS, Region, RegionMut, SMALL_COPY_BYTES, copy_local_threads, copy_threads,
};

/// A small deterministic generator (xorshift64*), so that every run checks the same plans.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Case {
    src: Vec<Vec<u8>>,
    src_bases: Vec<u64>,
    dst_sizes: Vec<usize>,
    dst_bases: Vec<u64>,
    src_addrs: Vec<u64>,
    dst_addrs: Vec<u64>,
    lengths: Vec<u64>,
}

fn case(seed: u64, n_blocks: usize, max_len: u64) -> Case {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let src_sizes = [1usize << 20, 3 << 19];
    let dst_sizes = vec![1usize << 20, 1 << 21, 1 << 19];
    let src: Vec<Vec<u8>> = src_sizes
        .iter()
        .map(|&n| (0..n).map(|_| rng.next() as u8).collect())
        .collect();
    // Declared bases far apart, in an order unlike the buffers' order.
    let src_bases = vec![0x7000_0000, 0x1000_0000];
    let dst_bases = vec![0x5_0000_0000, 0x2_0000_0000, 0x2_0020_0000];
    let (mut src_addrs, mut dst_addrs, mut lengths) = (vec![], vec![], vec![]);
    for k in 0..n_blocks {
        // Every 50th block is empty, some at a buffer's very end.
        let len = if k % 50 == 0 {
            0
        } else {
            1 + rng.below(max_len)
        };
        let i = rng.below(src.len() as u64) as usize;
        let j = rng.below(dst_sizes.len() as u64) as usize;
        let s = rng.below(src_sizes[i] as u64 - len + 1);
        let d = if k % 97 == 0 {
            dst_sizes[j] as u64 - len
        } else {
            rng.below(dst_sizes[j] as u64 - len + 1)
        };
        src_addrs.push(src_bases[i] + s);
        dst_addrs.push(dst_bases[j] + d);
        lengths.push(len);
    }
    Case {
        src,
        src_bases,
        dst_sizes,
        dst_bases,
        src_addrs,
        dst_addrs,
        lengths,
    }
}

fn run(c: &Case, threads: Option<usize>) -> (Result<u64, String>, Vec<Vec<u8>>) {
    let mut out: Vec<Vec<u8>> = c.dst_sizes.iter().map(|&n| vec![0xa5; n]).collect();
    let src: Vec<Region<'_>> = c
        .src
        .iter()
        .zip(&c.src_bases)
        .map(|(b, &base)| Region { base, bytes: b })
        .collect();
    let mut dst: Vec<RegionMut<'_>> = out
        .iter_mut()
        .zip(&c.dst_bases)
        .map(|(b, &base)| RegionMut { base, bytes: b })
        .collect();
    let copied = copy_local_threads(
        &c.src_addrs,
        &c.dst_addrs,
        &c.lengths,
        &src,
        &mut dst,
        threads,
    )
    .map_err(|e| e.to_string());
    (copied, out)
}

#[test]
fn several_threads_write_what_one_thread_writes() {
    for seed in 0..12 {
        // Long blocks overlap each other often; short ones rarely.
        let c = case(seed, 3000, if seed % 2 == 0 { 4096 } else { 600 });
        let (want_total, want) = run(&c, Some(1));
        let want_total = want_total.expect("a valid plan");
        assert_eq!(want_total, c.lengths.iter().sum::<u64>());
        for threads in [Some(2), Some(3), Some(4), Some(7), None] {
            let (total, got) = run(&c, threads);
            assert_eq!(total, Ok(want_total), "seed {seed}, threads {threads:?}");
            assert!(
                got == want,
                "seed {seed}, threads {threads:?}: bytes differ"
            );
        }
    }
}

#[test]
fn a_refused_plan_copies_nothing_on_any_thread_count() {
    let mut c = case(99, 3000, 2048);
    // The last block reaches one byte past its destination buffer.
    let last = c.lengths.len() - 1;
    c.lengths[last] = 64;
    c.dst_addrs[last] = c.dst_bases[0] + c.dst_sizes[0] as u64 - 63;
    for threads in [Some(1), Some(4), None] {
        let (copied, out) = run(&c, threads);
        let err = copied.expect_err("a block outside its buffers");
        assert!(err.contains(&format!("dst block {last}")), "{err}");
        assert!(out.iter().all(|b| b.iter().all(|&x| x == 0xa5)));
    }
}

#[test]
fn the_thread_count_follows_the_plan_size() {
    assert_eq!(copy_threads(None, SMALL_COPY_BYTES - 1, 10_000), 1);
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    assert_eq!(
        copy_threads(None, 1 << 30, 1 << 20),
        cores.min(MAX_DEFAULT_COPY_THREADS)
    );
    // Asked for: kept, but never more than one per block nor per 256 KiB.
    assert_eq!(copy_threads(Some(8), 1 << 30, 1 << 20), 8);
    assert_eq!(copy_threads(Some(8), 1 << 30, 3), 3);
    assert_eq!(copy_threads(Some(8), 512 << 10, 1 << 20), 2);
    assert_eq!(copy_threads(Some(8), 0, 0), 1);
}

#[test]
fn a_buffer_reaching_past_the_last_address_is_copied_whole() {
    // Declared 1 MiB below the top of the address space plus 16 bytes past it: blocks up to the
    // last address and one reaching past it, as many bytes as several threads would share.
    let size = (1usize << 20) + 16;
    let base = u64::MAX - (1 << 20) + 1;
    let source: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
    let mut lengths = vec![4096u64; 255];
    let mut dst_addrs: Vec<u64> = (0..255u64).map(|k| base + k * 4096).collect();
    dst_addrs.push(u64::MAX - 4095);
    lengths.push(4096 + 16);
    let src_addrs: Vec<u64> = dst_addrs.iter().map(|&d| d - base).collect();
    let src = [Region {
        base: 0,
        bytes: &source,
    }];
    let mut outputs = Vec::new();
    for threads in [Some(1), Some(4)] {
        let mut out = vec![0u8; size];
        let mut dst = [RegionMut {
            base,
            bytes: &mut out,
        }];
        let copied = copy_local_threads(&src_addrs, &dst_addrs, &lengths, &src, &mut dst, threads);
        assert_eq!(
            copied,
            Ok(lengths.iter().sum::<u64>()),
            "threads {threads:?}"
        );
        outputs.push(out);
    }
    assert!(outputs[0] == outputs[1]);
    assert!(outputs[0] == source);
}
