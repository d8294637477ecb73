//! The only place raw pointers from C become Rust references. Every helper checks what can be
//! checked (null, alignment, a byte size that fits in `isize`) and returns a [`Fail`] naming the
//! argument and its values; what cannot be checked (that the memory is live and holds `len`
//! values) is the caller's contract, stated in each helper's `# Safety` section and in the
//! header.

use std::ffi::{CStr, c_char};
use std::mem::{align_of, size_of};

use crate::{Fail, KvplanStatus};

/// The byte range `[start, end)` of `len` values of `T` at `ptr`, after the null, alignment
/// and size checks (`None` for an empty range).
pub(crate) fn byte_range<T>(
    ptr: *const T,
    len: usize,
    what: &str,
) -> Result<Option<(usize, usize)>, Fail> {
    if len == 0 {
        return Ok(None);
    }
    if ptr.is_null() {
        return Err(Fail::new(
            KvplanStatus::NullPointer,
            format!("{what} is null but its length is {len}"),
        ));
    }
    let start = ptr.addr();
    if !start.is_multiple_of(align_of::<T>()) {
        return Err(Fail::new(
            KvplanStatus::InvalidArgument,
            format!(
                "{what} at {start:#x} is not aligned to {} bytes",
                align_of::<T>()
            ),
        ));
    }
    let bytes = len
        .checked_mul(size_of::<T>())
        .filter(|&b| isize::try_from(b).is_ok())
        .and_then(|b| start.checked_add(b).map(|end| (b, end)));
    match bytes {
        Some((_, end)) => Ok(Some((start, end))),
        None => Err(Fail::new(
            KvplanStatus::InvalidArgument,
            format!(
                "{what}: {len} values of {} bytes at {start:#x} do not fit in the address space",
                size_of::<T>()
            ),
        )),
    }
}

/// The bytes `[start, end)` one `T` at a non-null `ptr` would occupy, without the alignment
/// check (for an overlap check that must come before a misaligned `ptr` is refused).
pub(crate) fn span<T>(ptr: *const T) -> (usize, usize) {
    let start = ptr.addr();
    (start, start.saturating_add(size_of::<T>()))
}

/// `len` values at `ptr` as a shared slice (an empty slice when `len` is 0, whatever `ptr`).
///
/// # Safety
/// When `len > 0`, `ptr` must point to `len` initialised values of `T` that stay valid and are
/// not written by anyone for the lifetime `'a`.
pub(crate) unsafe fn slice<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T], Fail> {
    match byte_range(ptr, len, what)? {
        None => Ok(&[]),
        // SAFETY: non-null, aligned, `len * size_of::<T>()` fits in isize and does not wrap
        // (checked by `byte_range`); validity and the absence of writers are the caller's
        // contract.
        Some(_) => Ok(unsafe { std::slice::from_raw_parts(ptr, len) }),
    }
}

/// `len` values at `ptr` as a mutable slice (an empty slice when `len` is 0, whatever `ptr`).
///
/// # Safety
/// When `len > 0`, `ptr` must point to `len` values of `T` (any bit pattern is a valid `u64`)
/// that stay valid for `'a` and that nothing else reads or writes meanwhile. The caller checks
/// beforehand that no other slice it builds overlaps this one.
pub(crate) unsafe fn slice_mut<'a, T>(
    ptr: *mut T,
    len: usize,
    what: &str,
) -> Result<&'a mut [T], Fail> {
    match byte_range(ptr.cast_const(), len, what)? {
        None => Ok(&mut []),
        // SAFETY: as in `slice`; exclusivity is the caller's contract plus its overlap check.
        Some(_) => Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) }),
    }
}

/// The value `ptr` points to, by shared reference.
///
/// # Safety
/// A non-null `ptr` must point to an initialised, live `T` that nobody writes during `'a`.
pub(crate) unsafe fn reference<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Fail> {
    byte_range(ptr, 1, what)?;
    // SAFETY: non-null and aligned (checked above); validity is the caller's contract.
    Ok(unsafe { &*ptr })
}

/// Writes `value` to `*ptr`.
///
/// # Safety
/// A non-null `ptr` must point to writable memory for one `T` that nothing else accesses during
/// the call. The old value is not dropped (only `Copy`-like plain data is written).
pub(crate) unsafe fn write<T: Copy>(ptr: *mut T, value: T, what: &str) -> Result<(), Fail> {
    byte_range(ptr.cast_const(), 1, what)?;
    // SAFETY: non-null and aligned (checked above); writability is the caller's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// A NUL-terminated string at `ptr`, checked to be UTF-8.
///
/// # Safety
/// A non-null `ptr` must point to a NUL-terminated string that stays valid and unwritten for
/// `'a`.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if ptr.is_null() {
        return Err(Fail::new(
            KvplanStatus::NullPointer,
            format!("{what} is a null string"),
        ));
    }
    // SAFETY: non-null; NUL termination and validity are the caller's contract.
    let raw = unsafe { CStr::from_ptr(ptr) };
    raw.to_str().map_err(|err| {
        Fail::new(
            KvplanStatus::InvalidArgument,
            format!("{what} is not UTF-8: {err}"),
        )
    })
}

/// Fails when two byte ranges overlap (two output columns, or an output and an input).
pub(crate) fn disjoint(
    a: Option<(usize, usize)>,
    a_name: &str,
    b: Option<(usize, usize)>,
    b_name: &str,
) -> Result<(), Fail> {
    if let (Some((a0, a1)), Some((b0, b1))) = (a, b)
        && a0 < b1
        && b0 < a1
    {
        return Err(Fail::new(
            KvplanStatus::InvalidArgument,
            format!(
                "{a_name} [{a0:#x}, {a1:#x}) overlaps {b_name} [{b0:#x}, {b1:#x}); give separate buffers"
            ),
        ));
    }
    Ok(())
}
