//! Reuse of plan output memory.
//!
//! Writing a 2M-block plan into fresh memory costs ~25 ms of page faults (the kernel maps and
//! zero-fills every page, and large frees go back to the OS), versus ~3 ms into a warm buffer
//! (see docs/design.md, Performance model). Plans therefore draw their buffers from this pool,
//! and a buffer comes back when the last NumPy array viewing it dies.

use std::sync::Mutex;

use kvplan_core::PlanError;

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
    // Sizes beyond the largest power of two cannot be allocated anyway: left as they are, the
    // allocation then fails with an error naming them.
    let Some(power) = values.checked_next_power_of_two() else {
        return values;
    };
    let step = (power / 8).max(1);
    values.div_ceil(step).saturating_mul(step)
}

/// `len` zeroed u64s, or `None` when the allocator refuses.
///
/// The size comes from a request (runs × pairs), so failure must be an error, not the abort of
/// `vec![0; len]`. Zeroed memory comes from `calloc`-style allocation: fresh pages arrive
/// already zero, so this costs no extra pass over a large buffer (a `resize` would).
fn try_zeroed(len: usize) -> Option<Vec<u64>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u64>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (len > 0, u64 is not zero-sized).
    let raw = unsafe { std::alloc::alloc_zeroed(layout) };
    if raw.is_null() {
        return None;
    }
    #[allow(clippy::cast_ptr_alignment)] // allocated with u64's alignment (`layout`)
    let slice = std::ptr::slice_from_raw_parts_mut(raw.cast::<u64>(), len);
    // SAFETY: the global allocator returned this memory for the layout of `[u64; len]`, which
    // is the layout a `Box<[u64]>` of `len` values owns and frees; all values are initialised
    // (zero bytes are a valid u64).
    Some(unsafe { Box::from_raw(slice) }.into_vec())
}

/// A buffer of at least `values` u64s: the most recently returned one that fits (its memory is
/// the most likely to still be in cache: rotating through several same-size buffers made every
/// plan write cache-cold memory), else a fresh one.
///
/// # Errors
/// [`PlanError::OutOfMemory`] when no pooled buffer fits and a fresh one cannot be allocated.
pub(crate) fn take(values: usize) -> Result<Vec<u64>, PlanError> {
    let mut pool = lock();
    if let Some(i) = pool.buffers.iter().rposition(|b| b.len() >= values) {
        pool.hits += 1;
        return Ok(pool.buffers.remove(i));
    }
    pool.misses += 1;
    drop(pool);
    // Slack is an optimisation: when the rounded size does not fit, the exact one may.
    let size = rounded(values);
    try_zeroed(size)
        .or_else(|| try_zeroed(values))
        .ok_or_else(|| PlanError::out_of_memory::<u64>("plan output", values))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_are_errors_not_aborts() {
        for values in [usize::MAX, usize::MAX / 2, (isize::MAX as usize) / 8 + 1] {
            assert!(try_zeroed(values).is_none());
            assert!(matches!(take(values), Err(PlanError::OutOfMemory { .. })));
        }
        assert_eq!(rounded(usize::MAX), usize::MAX);
        assert_eq!(try_zeroed(3), Some(vec![0; 3]));
    }
}

/// `(buffers pooled, bytes pooled, hits, misses)` of the plan output pool.
#[pyo3::pyfunction]
pub fn pool_stats() -> (usize, usize, u64, u64) {
    stats()
}
