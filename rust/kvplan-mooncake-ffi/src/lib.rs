//! Batch submission into Mooncake's native `TransferEngine`, without Python lists.
//!
//! Mooncake's Python binding takes three `list[int]` per batch and turns every element into a
//! C++ integer; for a plan of millions of blocks that hand-off costs far more than planning. The
//! same extension module (`mooncake/engine.so`) exports the C++ engine's own batch API
//! (`allocateBatchID`, `submitTransfer`, `getBatchTransferStatus`, `getTransferStatus`,
//! `freeBatchID`, `openSegment`),
//! and `TransferEngine.get_engine_ptr()` hands out the native engine behind a Python engine. This
//! crate opens the already-loaded module with `libloading`, looks those symbols up and fills
//! Mooncake's `TransferRequest` array straight from kvplan's address columns.
//!
//! Calling C++ member functions from Rust relies on facts that no header promises, so they are
//! pinned here and checked before use:
//!
//! * the Itanium C++ ABI on x86-64 Linux (the only target this crate enables): a member function
//!   takes `this` as its first argument; one returning a class with a destructor (Mooncake's
//!   `Status`) takes a hidden result pointer before `this`;
//! * libstdc++'s layouts of `std::vector<T>` (begin, end, end of storage) and of the C++11
//!   `std::string` (data pointer, length, 16-byte local buffer or capacity), both read only;
//! * the layouts of `TransferRequest` (56 bytes), `TransferStatus` and `Status` in the wheel
//!   version [`VERIFIED_VERSION`] (read from its machine code and checked against a live
//!   submission); the Python side refuses any other installed version and runs a self-test
//!   transfer before trusting the path.
//!
//! Mooncake keeps a pointer to each request until the batch is freed, so a [`Batch`] owns its
//! request array until `freeBatchID` succeeded, and leaks it rather than free memory the engine
//! may still read when the batch cannot be freed.
//!
//! A C++ exception thrown by Mooncake (only `std::bad_alloc` is possible on these paths) crosses
//! the `C-unwind` boundary; kvplan's bindings cannot catch a foreign exception, so the process
//! aborts instead of continuing with undefined state.

mod backoff;

use backoff::Backoff;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `mooncake-transfer-engine-non-cuda` release whose struct layouts this crate was verified
/// against.
pub const VERIFIED_VERSION: &str = "0.3.13.post1";

/// Error raised by this crate; `message` is meant for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FfiError {
    /// This build target has no verified calling convention for Mooncake's C++ API.
    Unsupported(String),
    /// The module could not be opened or lacks a symbol.
    Load(String),
    /// Mooncake returned a non-OK `Status` (code and message) from `call`.
    Engine {
        call: &'static str,
        code: i16,
        message: String,
    },
    /// The batch failed (one of its requests failed, or the engine reported a timeout).
    Failed(String),
    /// The batch did not finish within the deadline.
    TimedOut(String),
}

impl fmt::Display for FfiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FfiError::Unsupported(m) | FfiError::Load(m) | FfiError::Failed(m) => f.write_str(m),
            FfiError::TimedOut(m) => write!(f, "timed out: {m}"),
            FfiError::Engine {
                call,
                code,
                message,
            } => {
                write!(f, "{call} returned status {code}")?;
                if !message.is_empty() {
                    write!(f, " ({message})")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for FfiError {}

/// `mooncake::Transport::TransferRequest` in [`VERIFIED_VERSION`]: opcode, source, segment,
/// target offset, length, retry hint, transport hint, task group (56 bytes, 8-aligned).
#[repr(C)]
#[derive(Clone, Copy)]
struct TransferRequest {
    opcode: i32,
    source: u64,
    target_id: u64,
    target_offset: u64,
    length: u64,
    advise_retry_cnt: i32,
    transport_hint: i32,
    task_group_id: u64,
}

const _: () = assert!(std::mem::size_of::<TransferRequest>() == 56);
const _: () = assert!(std::mem::offset_of!(TransferRequest, source) == 8);
const _: () = assert!(std::mem::offset_of!(TransferRequest, length) == 32);
const _: () = assert!(std::mem::offset_of!(TransferRequest, task_group_id) == 48);

/// `TransferRequest::WRITE`.
const OPCODE_WRITE: i32 = 1;

/// libstdc++ `std::vector<T>`: three pointers.
#[repr(C)]
struct CxxVector<T> {
    begin: *const T,
    end: *const T,
    end_of_storage: *const T,
}

/// libstdc++ C++11 `std::string`: data pointer, length, then a 16-byte union (local buffer or
/// capacity). A data pointer outside the struct marks heap storage, so the callee reads it
/// through the pointer; Mooncake only ever reads it (it is passed as `const std::string&`).
#[repr(C)]
struct CxxString {
    data: *const u8,
    len: usize,
    capacity: usize,
    _unused: usize,
}

/// `mooncake::Status`: a 16-bit code (0 = OK) and an owned C string (`new[]`) or null.
#[repr(C)]
struct Status {
    code: i16,
    message: *mut c_char,
}

/// `mooncake::Transport::TransferStatus`.
#[repr(C)]
struct TransferStatus {
    state: i32,
    transferred_bytes: usize,
}

/// `TransferStatusEnum` values.
const STATUS_COMPLETED: i32 = 4;
const STATUS_TIMEOUT: i32 = 5;
const STATUS_FAILED: i32 = 6;

type AllocateFn = unsafe extern "C-unwind" fn(this: *mut c_void, batch_size: usize) -> u64;
type SubmitFn = unsafe extern "C-unwind" fn(
    ret: *mut Status,
    this: *mut c_void,
    batch: u64,
    entries: *const CxxVector<TransferRequest>,
) -> *mut Status;
type BatchStatusFn = unsafe extern "C-unwind" fn(
    ret: *mut Status,
    this: *mut c_void,
    batch: u64,
    status: *mut TransferStatus,
) -> *mut Status;
type TaskStatusFn = unsafe extern "C-unwind" fn(
    ret: *mut Status,
    this: *mut c_void,
    batch: u64,
    task: usize,
    status: *mut TransferStatus,
) -> *mut Status;
type FreeFn =
    unsafe extern "C-unwind" fn(ret: *mut Status, this: *mut c_void, batch: u64) -> *mut Status;
type OpenSegmentFn = unsafe extern "C-unwind" fn(this: *mut c_void, name: *const CxxString) -> u64;
type DeleteArrayFn = unsafe extern "C-unwind" fn(ptr: *mut c_void);

const SYM_ALLOCATE: &[u8] = b"_ZN8mooncake14TransferEngine15allocateBatchIDEm\0";
const SYM_SUBMIT: &[u8] =
    b"_ZN8mooncake14TransferEngine14submitTransferEmRKSt6vectorINS_9Transport15TransferRequestESaIS3_EE\0";
const SYM_BATCH_STATUS: &[u8] =
    b"_ZN8mooncake14TransferEngine22getBatchTransferStatusEmRNS_9Transport14TransferStatusE\0";
const SYM_TASK_STATUS: &[u8] =
    b"_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14TransferStatusE\0";
const SYM_FREE: &[u8] = b"_ZN8mooncake14TransferEngine11freeBatchIDEm\0";
const SYM_OPEN_SEGMENT: &[u8] =
    b"_ZN8mooncake14TransferEngine11openSegmentERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE\0";
/// `operator delete[](void*)`, to release a `Status` message allocated with `new[]`.
const SYM_DELETE_ARRAY: &[u8] = b"_ZdaPv\0";

/// The segment handle `openSegment` returns on failure.
const INVALID_SEGMENT: u64 = u64::MAX;

struct Symbols {
    allocate: AllocateFn,
    submit: SubmitFn,
    batch_status: BatchStatusFn,
    task_status: TaskStatusFn,
    free: FreeFn,
    open_segment: OpenSegmentFn,
    delete_array: Option<DeleteArrayFn>,
}

struct Shared {
    symbols: Symbols,
    this: *mut c_void,
    segments: Mutex<HashMap<String, u64>>,
    // Last so the module handle is released after everything that points into it.
    _library: libloading::Library,
}

// SAFETY: `this` points to a `mooncake::TransferEngine`, whose public methods are called
// concurrently from many threads by Mooncake's own Python binding (each with the GIL released);
// the symbols are plain function pointers and the segment cache is behind a mutex.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`: every method used here is safe to call from several threads at once.
unsafe impl Sync for Shared {}

/// A native Mooncake engine: the Python engine's C++ object plus the looked-up entry points.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

impl Engine {
    /// Open `module_path` (Mooncake's already imported `engine` extension) and bind to the
    /// native engine at `engine_ptr` (`TransferEngine.get_engine_ptr()` of an initialised
    /// engine).
    ///
    /// # Safety
    ///
    /// `engine_ptr` must be the address of a live, initialised `mooncake::TransferEngine` from
    /// that module, of version [`VERIFIED_VERSION`], and must stay alive (its Python engine not
    /// closed or freed) for as long as this value, its clones or any [`Batch`] exist.
    pub unsafe fn new(module_path: &str, engine_ptr: usize) -> Result<Engine, FfiError> {
        if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            return Err(FfiError::Unsupported(
                "native Mooncake submission is verified on x86-64 Linux only".into(),
            ));
        }
        if engine_ptr == 0 {
            return Err(FfiError::Load(
                "get_engine_ptr() returned a null engine".into(),
            ));
        }
        // SAFETY: loading runs the module's initialisers only when it is not loaded yet; the
        // caller passes the path of the module Python already imported, so this just takes
        // another reference to it.
        let library = unsafe { libloading::Library::new(module_path) }
            .map_err(|e| FfiError::Load(format!("cannot open {module_path}: {e}")))?;
        // SAFETY: each type below is the Itanium-ABI signature of the named member function
        // of `mooncake::TransferEngine` in VERIFIED_VERSION (hidden result pointer first for
        // functions returning `Status`, then `this`), read from that version's machine code.
        let symbols = unsafe {
            Symbols {
                allocate: *lookup::<AllocateFn>(&library, SYM_ALLOCATE)?,
                submit: *lookup::<SubmitFn>(&library, SYM_SUBMIT)?,
                batch_status: *lookup::<BatchStatusFn>(&library, SYM_BATCH_STATUS)?,
                task_status: *lookup::<TaskStatusFn>(&library, SYM_TASK_STATUS)?,
                free: *lookup::<FreeFn>(&library, SYM_FREE)?,
                open_segment: *lookup::<OpenSegmentFn>(&library, SYM_OPEN_SEGMENT)?,
                delete_array: lookup::<DeleteArrayFn>(&library, SYM_DELETE_ARRAY)
                    .ok()
                    .map(|s| *s),
            }
        };
        Ok(Engine {
            shared: Arc::new(Shared {
                symbols,
                this: engine_ptr as *mut c_void,
                segments: Mutex::new(HashMap::new()),
                _library: library,
            }),
        })
    }

    /// The segment handle of peer session `name` (`"host:port"`), opened once and cached.
    pub fn open_segment(&self, name: &str) -> Result<u64, FfiError> {
        let mut cache = self
            .shared
            .segments
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(&handle) = cache.get(name) {
            return Ok(handle);
        }
        let mut bytes = Vec::with_capacity(name.len() + 1);
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0); // `c_str()` reads the terminator
        let string = CxxString {
            data: bytes.as_ptr(),
            len: name.len(),
            capacity: name.len(),
            _unused: 0,
        };
        // SAFETY: `this` is live (constructor contract); `string` is a valid libstdc++ string
        // whose heap data (`bytes`, NUL-terminated) outlives the call, which only reads it.
        let handle =
            unsafe { (self.shared.symbols.open_segment)(self.shared.this, &raw const string) };
        drop(bytes);
        if handle == INVALID_SEGMENT {
            return Err(FfiError::Failed(format!(
                "openSegment({name:?}) failed: the peer is unknown or unreachable"
            )));
        }
        cache.insert(name.to_owned(), handle);
        Ok(handle)
    }

    /// Submit one batch of writes (block `i`: `lengths[i]` bytes from local `src[i]` to the
    /// peer's `dst[i]`) to `segment`; returns once Mooncake accepted the batch.
    pub fn submit_write(
        &self,
        segment: u64,
        src: &[u64],
        dst: &[u64],
        lengths: &[u64],
    ) -> Result<Batch, FfiError> {
        if src.len() != dst.len() || src.len() != lengths.len() {
            return Err(FfiError::Failed(format!(
                "{} sources, {} destinations and {} lengths",
                src.len(),
                dst.len(),
                lengths.len()
            )));
        }
        let requests: Vec<TransferRequest> = src
            .iter()
            .zip(dst)
            .zip(lengths)
            .map(|((&source, &target_offset), &length)| TransferRequest {
                opcode: OPCODE_WRITE,
                source,
                target_id: segment,
                target_offset,
                length,
                advise_retry_cnt: 0,
                transport_hint: 0,
                task_group_id: 0,
            })
            .collect();
        let bytes = lengths.iter().sum();
        let symbols = &self.shared.symbols;
        // SAFETY: `this` is live (constructor contract); allocateBatchID only allocates.
        let id = unsafe { (symbols.allocate)(self.shared.this, requests.len()) };
        let mut batch = Batch {
            shared: Arc::clone(&self.shared),
            id,
            requests,
            bytes,
            started: Instant::now(),
            finished: false,
        };
        let range = batch.requests.as_ptr_range();
        let vector = CxxVector {
            begin: range.start,
            end: range.end,
            end_of_storage: range.end,
        };
        let mut status = Status {
            code: 0,
            message: std::ptr::null_mut(),
        };
        // SAFETY: `id` is a batch of capacity `requests.len()` just allocated on this engine;
        // `vector` is a valid read-only libstdc++ vector over the batch's own request array,
        // which stays alive and unmoved until the batch is freed (`Batch` owns it); `status`
        // is writable storage of `Status`'s layout for the hidden result.
        unsafe { (symbols.submit)(&raw mut status, self.shared.this, id, &raw const vector) };
        if let Err(error) = self.shared.take_status("submitTransfer", status) {
            // Nothing was queued for a refused batch (Mooncake frees it the same way).
            batch.release(Duration::from_secs(5));
            return Err(error);
        }
        Ok(batch)
    }
}

impl Shared {
    /// Turn a returned `Status` into a result, releasing its message.
    fn take_status(&self, call: &'static str, status: Status) -> Result<(), FfiError> {
        let message = if status.message.is_null() {
            String::new()
        } else {
            // SAFETY: a non-null message is a NUL-terminated string Mooncake allocated with
            // `new[]` for this status; nothing else refers to it.
            let text = unsafe { CStr::from_ptr(status.message) }
                .to_string_lossy()
                .into_owned();
            if let Some(delete_array) = self.symbols.delete_array {
                // SAFETY: the message came from `operator new[]` of the module's own C++
                // runtime (`_ZdaPv` is looked up through the same module), and is freed once.
                unsafe { delete_array(status.message.cast()) };
            }
            text
        };
        if status.code == 0 {
            Ok(())
        } else {
            Err(FfiError::Engine {
                call,
                code: status.code,
                message,
            })
        }
    }
}

/// One submitted batch. Owns the request array Mooncake reads until the batch is freed; must
/// be waited on ([`Batch::wait`]); dropping it unwaited waits with a 30 s deadline.
pub struct Batch {
    shared: Arc<Shared>,
    id: u64,
    requests: Vec<TransferRequest>,
    bytes: u64,
    started: Instant,
    finished: bool,
}

// SAFETY: a batch id may be polled and freed from any thread (Mooncake's binding does so with
// the GIL released); the request array is only read by Mooncake.
unsafe impl Send for Batch {}

impl Batch {
    /// Blocks in this batch.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True for a batch of no blocks.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Bytes in this batch.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Wait until every block landed, failed, or `timeout` (counted from the submit, plus 1 ns
    /// per byte as Mooncake's binding allows) passed; then free the batch. The status is polled
    /// a few times back to back, then between yields, then between sleeps growing from 20 us to
    /// 1 ms: a long wait leaves the cores to other work.
    pub fn wait(mut self, timeout: Duration) -> Result<(), FfiError> {
        self.wait_inner(timeout)
    }

    fn wait_inner(&mut self, timeout: Duration) -> Result<(), FfiError> {
        let deadline = self.started + timeout + Duration::from_nanos(self.bytes);
        let mut backoff = Backoff::default();
        let outcome = loop {
            let mut state = TransferStatus {
                state: 0,
                transferred_bytes: 0,
            };
            let mut status = Status {
                code: 0,
                message: std::ptr::null_mut(),
            };
            // SAFETY: `id` is a live batch of this engine (not yet freed: `finished` is false);
            // `state` and `status` are writable storage of the callee's layouts.
            unsafe {
                (self.shared.symbols.batch_status)(
                    &raw mut status,
                    self.shared.this,
                    self.id,
                    &raw mut state,
                )
            };
            if let Err(error) = self.shared.take_status("getBatchTransferStatus", status) {
                break Err(error);
            }
            match state.state {
                STATUS_COMPLETED => break Ok(()),
                STATUS_FAILED => {
                    break Err(FfiError::Failed(format!(
                        "a block of this {}-block batch failed; the reason is in the engine log",
                        self.requests.len()
                    )));
                }
                STATUS_TIMEOUT => {
                    break Err(FfiError::TimedOut(
                        "the engine reported the batch timed out".into(),
                    ));
                }
                _ => {}
            }
            if Instant::now() > deadline {
                break Err(FfiError::TimedOut(format!(
                    "{}-block batch still in flight after {:?}",
                    self.requests.len(),
                    deadline - self.started
                )));
            }
            backoff.pause(deadline);
        };
        // After a failure other blocks may still be in flight: keep trying to free until the
        // engine lets go of every request (or give up and leak them) before returning.
        self.release(timeout);
        outcome
    }

    /// Whether task `task` of this batch is over (every slice landed or failed), polling it
    /// with `getTransferStatus`, which is also what marks the task finished for `freeBatchID`.
    /// An error from the engine counts as not over (the caller retries until its deadline).
    fn task_over(&self, task: usize) -> bool {
        let mut state = TransferStatus {
            state: 0,
            transferred_bytes: 0,
        };
        let mut status = Status {
            code: 0,
            message: std::ptr::null_mut(),
        };
        // SAFETY: `id` is a live batch of this engine (not yet freed) holding `requests.len()`
        // tasks, one per request, and `task` is below that; `state` and `status` are writable
        // storage of the callee's layouts.
        unsafe {
            (self.shared.symbols.task_status)(
                &raw mut status,
                self.shared.this,
                self.id,
                task,
                &raw mut state,
            )
        };
        self.shared.take_status("getTransferStatus", status).is_ok()
            && matches!(state.state, STATUS_COMPLETED | STATUS_FAILED)
    }

    /// Free the batch once Mooncake no longer uses it. If it still refuses after `grace`, the
    /// batch and its requests are leaked: freeing memory the engine may still read is worse.
    ///
    /// `freeBatchID` refuses while any task is not marked finished, and only the per-task
    /// `getTransferStatus` marks one: `getBatchTransferStatus` stops at the first failed task,
    /// so after a peer refused a batch the tasks behind it are never marked and the batch
    /// could not be freed until `grace` ran out (30 s, keeping the process from exiting). So
    /// each refused free polls the tasks not yet seen over, then tries again.
    fn release(&mut self, grace: Duration) {
        if self.finished {
            return;
        }
        self.finished = true;
        let give_up = Instant::now() + grace;
        // Tasks [0, over) were seen over, so the engine marked them finished.
        let mut over = 0;
        loop {
            let mut status = Status {
                code: 0,
                message: std::ptr::null_mut(),
            };
            // SAFETY: `id` is a live batch of this engine, freed at most once (`finished`).
            unsafe { (self.shared.symbols.free)(&raw mut status, self.shared.this, self.id) };
            if self.shared.take_status("freeBatchID", status).is_ok() {
                return;
            }
            if Instant::now() > give_up {
                std::mem::forget(std::mem::take(&mut self.requests));
                return;
            }
            // Every task after `over` is polled (each one is marked once it is over), but
            // `over` only advances over a prefix of tasks seen over.
            let mut all_over = true;
            let first = over;
            for task in first..self.requests.len() {
                let done = self.task_over(task);
                if done && all_over {
                    over = task + 1;
                }
                all_over &= done;
            }
            if !all_over {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.wait_inner(Duration::from_secs(30));
        }
    }
}

/// Look `name` up in `library` as a `T`.
///
/// # Safety
///
/// `T` must be the exact type of the symbol.
unsafe fn lookup<'lib, T>(
    library: &'lib libloading::Library,
    name: &[u8],
) -> Result<libloading::Symbol<'lib, T>, FfiError> {
    // SAFETY: the caller guarantees `T` matches the symbol.
    unsafe { library.get::<T>(name) }.map_err(|e| {
        let shown = String::from_utf8_lossy(&name[..name.len() - 1]);
        FfiError::Load(format!("the Mooncake module lacks {shown}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_null_engine_is_refused_before_anything_is_loaded() {
        // SAFETY: the pointer is null, which `new` rejects before using it or loading anything.
        let err = unsafe { Engine::new("/nonexistent/engine.so", 0) }.err();
        let expected = if cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            FfiError::Load("get_engine_ptr() returned a null engine".into())
        } else {
            FfiError::Unsupported(
                "native Mooncake submission is verified on x86-64 Linux only".into(),
            )
        };
        assert_eq!(err, Some(expected));
    }

    #[test]
    fn a_missing_module_is_a_load_error() {
        // SAFETY: the module does not exist, so nothing is loaded and the pointer is never used.
        match unsafe { Engine::new("/nonexistent/engine.so", 8) } {
            Err(FfiError::Load(message)) => assert!(message.contains("/nonexistent/engine.so")),
            Err(FfiError::Unsupported(_)) => {}
            other => panic!("expected a load error, got {:?}", other.err()),
        }
    }

    #[test]
    fn errors_read_as_sentences() {
        let err = FfiError::Engine {
            call: "submitTransfer",
            code: 2,
            message: "too many".into(),
        };
        assert_eq!(
            err.to_string(),
            "submitTransfer returned status 2 (too many)"
        );
        assert_eq!(FfiError::TimedOut("x".into()).to_string(), "timed out: x");
    }
}
