//! Staged rounds (`Template.plan_rounds`): arguments converted, the core's `rounds` module
//! called, and `StagedRounds` / `StagedRound` / `RoundManifest` over its output.

use std::sync::Arc;

use kvplan_core::{
    Arena, FlatBuffer, PageIndex, Request, RoundBlocks, RoundManifest, RoundsPlanner, StagedRounds,
    Template,
};
use numpy::PyArray1;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PySlice};

use crate::errors::to_py_err;
use crate::input::RequestPlanner;
use crate::plan::{Column, PyTransferPlan, pooled_columns};
use crate::pool;
use crate::request::{Loose, RequestInput};

/// What a decode is told about one round of a staged request (`StagedRound.manifest`).
#[pyclass(frozen, eq, name = "RoundManifest", module = "kvplan._core")]
#[derive(PartialEq, Eq)]
pub struct PyRoundManifest {
    inner: RoundManifest,
}

#[pymethods]
impl PyRoundManifest {
    /// The round's position, from 0.
    #[getter]
    fn index(&self) -> u32 {
        self.inner.index
    }
    /// Rounds of the request.
    #[getter]
    fn n_rounds(&self) -> u32 {
        self.inner.n_rounds
    }
    /// The round buffer it uses (`index % buffers`).
    #[getter]
    fn buffer(&self) -> u32 {
        self.inner.buffer
    }
    /// Network blocks the round sends.
    #[getter]
    fn n_network_blocks(&self) -> u32 {
        self.inner.n_network_blocks
    }
    /// `(sender index, number of senders)` into the decode arena.
    #[getter]
    fn sender(&self) -> (u32, u32) {
        self.inner.sender
    }
    /// Bytes of the request before this round.
    #[getter]
    fn offset(&self) -> u64 {
        self.inner.offset
    }
    /// Bytes the round moves.
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes
    }
    /// Bytes of the whole request.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes
    }
    /// Offsets `(start, end)` of the decode arena the round's bytes land in.
    #[getter]
    fn dst_bytes_range(&self) -> (u64, u64) {
        self.inner.dst_bytes_range()
    }
    /// Whether this is the request's last round.
    #[getter]
    fn is_last(&self) -> bool {
        self.inner.is_last()
    }
    /// The fixed 64-byte wire form.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }
    /// Reads `to_bytes`'s form back; a `KvPlanError` names what is wrong.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        RoundManifest::from_bytes(data)
            .map(|inner| Self { inner })
            .map_err(to_py_err)
    }
    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!(
            "RoundManifest(index={}, n_rounds={}, buffer={}, offset={}, bytes={}, \
             total_bytes={}, dst_bytes_range={:?}, sender={:?})",
            m.index,
            m.n_rounds,
            m.buffer,
            m.offset,
            m.bytes,
            m.total_bytes,
            m.dst_bytes_range(),
            m.sender
        )
    }
}

/// One round: a gather into its prefill round buffer, the network block into the decode round
/// buffer of the same number, a scatter out of it.
#[pyclass(frozen, name = "StagedRound", module = "kvplan._core")]
pub struct PyStagedRound {
    /// The round's position, from 0.
    #[pyo3(get)]
    index: usize,
    /// The round buffer it uses on both sides.
    #[pyo3(get)]
    buffer: u32,
    /// Prefill memory → prefill round buffer.
    #[pyo3(get)]
    gather: Py<PyTransferPlan>,
    /// Prefill round buffer → decode round buffer.
    #[pyo3(get)]
    network: Py<PyTransferPlan>,
    /// Decode round buffer → decode memory.
    #[pyo3(get)]
    scatter: Py<PyTransferPlan>,
    /// What the decode is told about the round.
    #[pyo3(get)]
    manifest: Py<PyRoundManifest>,
}

#[pymethods]
impl PyStagedRound {
    fn __repr__(&self, py: Python<'_>) -> String {
        let blocks = |p: &Py<PyTransferPlan>| p.borrow(py).n_blocks_value();
        format!(
            "StagedRound(index={}, buffer={}, bytes={}, gather={}, network={}, scatter={} \
             blocks)",
            self.index,
            self.buffer,
            self.manifest.get().inner.bytes,
            blocks(&self.gather),
            blocks(&self.network),
            blocks(&self.scatter)
        )
    }
}

/// A request's staged plan in rounds through bounded arenas (`Template.plan_rounds`).
#[pyclass(frozen, sequence, name = "StagedRounds", module = "kvplan._core")]
pub struct PyStagedRounds {
    rounds: Vec<Py<PyStagedRound>>,
    /// Bytes of the request.
    #[pyo3(get)]
    bytes: u64,
    /// The most bytes one round holds.
    #[pyo3(get)]
    buffer_bytes: u64,
    /// Round buffers per arena.
    #[pyo3(get)]
    buffers: u32,
    /// Network blocks of all rounds.
    #[pyo3(get)]
    n_network_blocks: usize,
    /// Blocks of the request's direct plan.
    #[pyo3(get)]
    direct_blocks: usize,
    /// Network blocks of the unchunked staged plan (`plan_staged`).
    #[pyo3(get)]
    staged_network_blocks: usize,
    /// `(sender index, number of senders)` into the decode arena.
    #[pyo3(get)]
    sender: (u32, u32),
    /// Offsets `(start, end)` of the decode arena this sender's share covers.
    #[pyo3(get)]
    dst_share: (u64, u64),
    /// The core's stages of every round (`StagedRounds.stages`).
    stages: &'static [kvplan_core::Stage],
}

#[pymethods]
impl PyStagedRounds {
    /// The stages each round runs, in order: `(kind, side, part, reads, writes)` each.
    #[getter]
    fn stages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        crate::stages::stage_tuple(py, self.stages)
    }

    fn __len__(&self) -> usize {
        self.rounds.len()
    }

    fn __getitem__(&self, py: Python<'_>, index: isize) -> PyResult<Py<PyStagedRound>> {
        let n = self.rounds.len();
        let at = if index < 0 {
            index.checked_add_unsigned(n)
        } else {
            Some(index)
        };
        match at.and_then(|i| usize::try_from(i).ok()).filter(|&i| i < n) {
            Some(i) => Ok(self.rounds[i].clone_ref(py)),
            None => Err(PyIndexError::new_err(format!(
                "round index {index} is out of range for {n} rounds"
            ))),
        }
    }

    fn __iter__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let list = pyo3::types::PyList::new(py, self.rounds.iter().map(|r| r.clone_ref(py)))?;
        Ok(list.try_iter()?.into_any().unbind())
    }

    /// Every round's manifest, in order.
    #[getter]
    fn manifests(&self, py: Python<'_>) -> Vec<Py<PyRoundManifest>> {
        self.rounds
            .iter()
            .map(|r| r.get().manifest.clone_ref(py))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "StagedRounds({} rounds of at most {} bytes, bytes={}, buffers={}, \
             n_network_blocks={}, direct_blocks={}, sender={:?})",
            self.rounds.len(),
            self.buffer_bytes,
            self.bytes,
            self.buffers,
            self.n_network_blocks,
            self.direct_blocks,
            self.sender
        )
    }
}

/// One request planned in rounds through two arenas.
struct PlanRounds<'t>(&'t Template, Arena, Arena, u32);

impl RequestPlanner for PlanRounds<'_> {
    type Output = kvplan_core::Result<StagedRounds>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        RoundsPlanner::new(self.0).plan_with(
            request,
            (self.1, self.2),
            self.3,
            |n| {
                Ok(FlatBuffer {
                    data: pool::take(n.saturating_mul(3))?,
                    capacity: n,
                })
            },
            |scratch| pool::give_back(scratch.data),
        )
    }
}

/// One stage's columns for every round: NumPy arrays over the core's buffer, each round a view.
/// A stage far smaller than its buffer (a pooled buffer lent for a few blocks) is copied out and
/// its buffer goes straight back to the pool, so live rounds never hold a large plan's memory.
fn stage_columns(py: Python<'_>, blocks: RoundBlocks) -> PyResult<([Column; 3], Vec<usize>)> {
    let RoundBlocks {
        buffer,
        n_blocks,
        round_offsets,
    } = blocks;
    let FlatBuffer { data, capacity } = buffer;
    if n_blocks.saturating_mul(12) < data.len() {
        let columns = [0, 1, 2].map(|k| {
            PyArray1::from_slice(py, &data[k * capacity..k * capacity + n_blocks]).unbind()
        });
        pool::give_back(data);
        return Ok((columns, round_offsets));
    }
    let columns = pooled_columns(py, data, capacity, n_blocks)?;
    Ok((columns, round_offsets))
}

/// Round `k`'s view of a stage's columns.
fn round_columns(
    py: Python<'_>,
    columns: &[Column; 3],
    (a, b): (usize, usize),
) -> PyResult<[Column; 3]> {
    let slice = PySlice::new(py, a as isize, b as isize, 1);
    let view = |c: &Column| -> PyResult<Column> {
        Ok(c.bind(py)
            .as_any()
            .get_item(&slice)?
            .cast_into::<PyArray1<u64>>()?
            .unbind())
    };
    Ok([view(&columns[0])?, view(&columns[1])?, view(&columns[2])?])
}

/// Plans one request (as `plan`) as a staged plan in rounds through `src_arena = (addr,
/// size)` (prefill memory) and `dst_arena = (addr, size)` (decode memory), `buffers` round
/// buffers each.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_rounds(
    py: Python<'_>,
    template: &Arc<Template>,
    fingerprints: Option<(u64, u64)>,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: Option<&Bound<'_, PyAny>>,
    (src_arena, dst_arena): ((u64, u64), (u64, u64)),
    buffers: u32,
    n_tokens: Option<u64>,
) -> PyResult<PyStagedRounds> {
    let loose = Loose {
        n_tokens,
        ..Loose::default()
    };
    let request = RequestInput::of_args("plan_rounds", src_pages, dst_pages, loose)?;
    let arena = |(addr, size): (u64, u64)| Arena { addr, size };
    let planner = PlanRounds(template, arena(src_arena), arena(dst_arena), buffers);
    let planned = request.plan(py, planner)?.map_err(to_py_err)?;
    let plan_stages = kvplan_core::MultiStage::stages(&planned);
    let StagedRounds {
        gather,
        network,
        scatter,
        manifests,
        buffers,
        buffer_bytes,
        bytes,
        direct_blocks,
        staged_network_blocks,
        sender,
        dst_share,
    } = planned;
    let n_network_blocks = network.n_blocks;
    let stages = [
        stage_columns(py, gather)?,
        stage_columns(py, network)?,
        stage_columns(py, scatter)?,
    ];
    let mut rounds = Vec::new();
    rounds.try_reserve_exact(manifests.len()).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate {} rounds (a round buffer of {buffer_bytes} bytes for a request of \
             {bytes} bytes); give larger arenas",
            manifests.len()
        ))
    })?;
    for (k, manifest) in manifests.into_iter().enumerate() {
        let part =
            |(columns, offsets): &([Column; 3], Vec<usize>)| -> PyResult<Py<PyTransferPlan>> {
                let (a, b) = (offsets[k], offsets[k + 1]);
                let plan = kvplan_core::Plan {
                    n_runs: b - a,
                    total_bytes: manifest.bytes,
                    pair_offsets: vec![0, b - a],
                    ..kvplan_core::Plan::default()
                };
                // A round holding the whole stage takes its columns as they are.
                let view = if (a, b) == (0, offsets.last().copied().unwrap_or(0)) {
                    [0, 1, 2].map(|c| columns[c].clone_ref(py))
                } else {
                    round_columns(py, columns, (a, b))?
                };
                Py::new(
                    py,
                    PyTransferPlan::packed(view, Arc::clone(template), &plan, fingerprints),
                )
            };
        let round = PyStagedRound {
            index: k,
            buffer: manifest.buffer,
            gather: part(&stages[0])?,
            network: part(&stages[1])?,
            scatter: part(&stages[2])?,
            manifest: Py::new(py, PyRoundManifest { inner: manifest })?,
        };
        rounds.push(Py::new(py, round)?);
    }
    Ok(PyStagedRounds {
        rounds,
        bytes,
        buffer_bytes,
        buffers,
        n_network_blocks,
        direct_blocks,
        staged_network_blocks,
        sender,
        dst_share,
        stages: plan_stages,
    })
}
