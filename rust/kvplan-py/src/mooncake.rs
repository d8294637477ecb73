//! Mooncake's native batch API for Python (`kvplan-mooncake-ffi` does the foreign calls): a plan's
//! uint64 columns go to the engine as one request array, with the GIL released for the whole
//! submit and wait.

use std::sync::Mutex;
use std::time::Duration;

use kvplan_mooncake_ffi::{Batch, Engine, FfiError, VERIFIED_VERSION};
use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyImportError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

fn to_py(err: FfiError) -> PyErr {
    match err {
        FfiError::Unsupported(_) | FfiError::Load(_) => PyImportError::new_err(err.to_string()),
        FfiError::TimedOut(_) => PyTimeoutError::new_err(err.to_string()),
        FfiError::Engine { .. } | FfiError::Failed(_) => PyRuntimeError::new_err(err.to_string()),
    }
}

fn columns<'a>(
    src: &'a PyReadonlyArray1<'_, u64>,
    dst: &'a PyReadonlyArray1<'_, u64>,
    lengths: &'a PyReadonlyArray1<'_, u64>,
) -> PyResult<(&'a [u64], &'a [u64], &'a [u64])> {
    let contiguous =
        |_| PyValueError::new_err("address columns must be C-contiguous uint64 arrays");
    let (s, d, n) = (
        src.as_slice().map_err(contiguous)?,
        dst.as_slice().map_err(contiguous)?,
        lengths.as_slice().map_err(contiguous)?,
    );
    if s.len() != d.len() || s.len() != n.len() {
        return Err(PyValueError::new_err(format!(
            "{} sources, {} destinations and {} lengths",
            s.len(),
            d.len(),
            n.len()
        )));
    }
    Ok((s, d, n))
}

fn seconds(timeout_s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout_s).map_err(|_| {
        PyValueError::new_err(format!(
            "timeout_s must be a non-negative number of seconds, got {timeout_s}"
        ))
    })
}

/// The native engine behind one initialised `mooncake.engine.TransferEngine`.
#[pyclass(module = "kvplan._core", name = "MooncakeNative", frozen)]
pub struct PyMooncakeNative {
    engine: Engine,
    // Holds the Python engine, and so the C++ engine it owns, alive while this object or any of
    // its batches (which hold this object) exist: the invariant `Engine::new` requires.
    _python_engine: Py<PyAny>,
}

#[pymethods]
impl PyMooncakeNative {
    /// Bind to `engine` (initialised) through its extension module at `module_path`;
    /// `version` is the installed wheel's version, which must be the verified one.
    #[new]
    fn new(engine: Bound<'_, PyAny>, module_path: &str, version: &str) -> PyResult<Self> {
        if version != VERIFIED_VERSION {
            return Err(PyImportError::new_err(format!(
                "native Mooncake submission is verified against {VERIFIED_VERSION}, not {version}"
            )));
        }
        let pointer: usize = engine.call_method0("get_engine_ptr")?.extract()?;
        // SAFETY: `pointer` comes from `get_engine_ptr()` of `engine`, which the caller
        // initialised, of the verified version (checked above); `_python_engine` keeps it alive
        // for as long as this object and its batches.
        let native = unsafe { Engine::new(module_path, pointer) }.map_err(to_py)?;
        Ok(Self {
            engine: native,
            _python_engine: engine.unbind(),
        })
    }

    /// The version whose layouts the native path was verified against.
    #[classattr]
    const VERIFIED_VERSION: &'static str = VERIFIED_VERSION;

    /// Write `lengths[i]` bytes from `src[i]` to the peer's `dst[i]` for every block, as one
    /// batch, and wait for it; the GIL is released throughout.
    fn write(
        &self,
        py: Python<'_>,
        peer: &str,
        src: PyReadonlyArray1<'_, u64>,
        dst: PyReadonlyArray1<'_, u64>,
        lengths: PyReadonlyArray1<'_, u64>,
        timeout_s: f64,
    ) -> PyResult<()> {
        let (s, d, n) = columns(&src, &dst, &lengths)?;
        let timeout = seconds(timeout_s)?;
        let engine = &self.engine;
        py.detach(|| {
            let segment = engine.open_segment(peer)?;
            engine.submit_write(segment, s, d, n)?.wait(timeout)
        })
        .map_err(to_py)
    }

    /// Submit the blocks as one batch and return once Mooncake accepted it (GIL released);
    /// the returned batch must be waited on.
    fn submit(
        slf: Bound<'_, Self>,
        peer: &str,
        src: PyReadonlyArray1<'_, u64>,
        dst: PyReadonlyArray1<'_, u64>,
        lengths: PyReadonlyArray1<'_, u64>,
    ) -> PyResult<PyMooncakeBatch> {
        let (s, d, n) = columns(&src, &dst, &lengths)?;
        let engine = &slf.get().engine;
        let batch = slf
            .py()
            .detach(|| {
                let segment = engine.open_segment(peer)?;
                engine.submit_write(segment, s, d, n)
            })
            .map_err(to_py)?;
        Ok(PyMooncakeBatch {
            batch: Mutex::new(Some(batch)),
            _owner: slf.unbind(),
        })
    }
}

/// One submitted native batch; :meth:`wait` exactly once.
#[pyclass(module = "kvplan._core", name = "MooncakeBatch", frozen)]
pub struct PyMooncakeBatch {
    batch: Mutex<Option<Batch>>,
    // Dropped after `batch` (field order), which may still wait on the engine this keeps alive.
    _owner: Py<PyMooncakeNative>,
}

#[pymethods]
impl PyMooncakeBatch {
    /// Blocks in the batch (0 once waited on).
    fn __len__(&self) -> usize {
        self.batch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(0, Batch::len)
    }

    /// Wait until every block landed or one failed, then free the batch (GIL released).
    /// `timeout_s` counts from the submit, plus 1 ns per byte.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = seconds(timeout_s)?;
        let batch = self
            .batch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(batch) = batch else {
            return Err(PyRuntimeError::new_err(
                "this Mooncake batch was already waited on",
            ));
        };
        py.detach(move || batch.wait(timeout)).map_err(to_py)
    }
}
