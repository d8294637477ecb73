//! Reuse of plan output memory.
//!
//! Writing a 2M-block plan into fresh memory costs ~25 ms of page faults (the kernel maps and
//! zero-fills every page, and large frees go back to the OS), versus ~3 ms into a warm buffer
//! (design.md §6). Plans therefore draw their buffers from this pool, and a buffer comes back
//! when the last NumPy array viewing it dies.

use std::sync::Mutex;

/// Buffers kept for reuse, at most.
const MAX_POOLED_BUFFERS: usize = 4;
/// Bytes kept for reuse, at most (larger buffers are freed when returned).
const MAX_POOLED_BYTES: usize = 1 << 30;

struct Pool {
    buffers: Vec<Vec<u64>>,
    hits: u64,
    misses: u64,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: Vec::new(),
    hits: 0,
    misses: 0,
});

fn lock() -> std::sync::MutexGuard<'static, Pool> {
    // A panic while holding the lock cannot leave the list inconsistent; keep using it.
    POOL.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Rounds a size up to one of 8 steps per power of two (≤ 12.5 % slack), so that requests of
/// similar size share buffers without doubling memory.
fn rounded(values: usize) -> usize {
    if values <= 64 {
        return 64;
    }
    let step = (values.next_power_of_two() / 8).max(1);
    values.div_ceil(step).saturating_mul(step)
}

/// A buffer of at least `values` u64s: the most recently returned one that fits (its memory is
/// the most likely to still be in cache: rotating through several same-size buffers made every
/// plan write cache-cold memory), else a fresh one.
pub(crate) fn take(values: usize) -> Vec<u64> {
    let mut pool = lock();
    if let Some(i) = pool.buffers.iter().rposition(|b| b.len() >= values) {
        pool.hits += 1;
        return pool.buffers.remove(i);
    }
    pool.misses += 1;
    drop(pool);
    vec![0; rounded(values)]
}

/// Gives a buffer back for reuse (or frees it when the pool is full).
pub(crate) fn give_back(buffer: Vec<u64>) {
    let bytes = buffer.len() * 8;
    if bytes == 0 || bytes > MAX_POOLED_BYTES {
        return;
    }
    let mut pool = lock();
    pool.buffers.push(buffer);
    // Evict the smallest buffers first: large ones are the expensive ones to fault in again.
    while pool.buffers.len() > MAX_POOLED_BUFFERS
        || pool.buffers.iter().map(|b| b.len() * 8).sum::<usize>() > MAX_POOLED_BYTES
    {
        let smallest = (0..pool.buffers.len())
            .min_by_key(|&i| pool.buffers[i].len())
            .unwrap_or(0);
        let evicted = pool.buffers.remove(smallest);
        drop(evicted);
    }
}

/// `(buffers pooled, bytes pooled, hits, misses)`.
pub(crate) fn stats() -> (usize, usize, u64, u64) {
    let pool = lock();
    (
        pool.buffers.len(),
        pool.buffers.iter().map(|b| b.len() * 8).sum(),
        pool.hits,
        pool.misses,
    )
}
