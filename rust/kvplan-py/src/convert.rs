//! Conversion plans (`ConversionTemplate`): arguments converted, the core's `convert` module
//! called, its plan handed out as NumPy columns.

use kvplan_core::planners::convert::{ConversionPlan, ConversionTemplate};
use kvplan_core::{KvDtype, PageIndex, Request, ScaleFormat};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py_err;
use crate::input::RequestPlanner;
use crate::layout::PyLayout;
use crate::options::template_options;
use crate::request::{Loose, RequestInput, shift_after};

type U64s = Py<PyArray1<u64>>;
type U8s = Py<PyArray1<u8>>;

/// A template for transfers between layouts whose paired entries hold different KV
/// representations: pairs as `Template` does and converts on the prefill.
#[pyclass(frozen, name = "ConversionTemplate", module = "kvplan._core")]
pub struct PyConversionTemplate {
    inner: ConversionTemplate,
}

/// One request's conversion plan: gather, convert rows, network, scatter (see docs/api.md,
/// "Conversion plans").
#[pyclass(frozen, name = "ConversionPlan", module = "kvplan._core")]
pub struct PyConversionPlan {
    /// `(src_addrs, dst_addrs, lengths)`: prefill memory → gathered area.
    #[pyo3(get)]
    gather: (U64s, U64s, U64s),
    /// `(src_addrs, dst_addrs, lengths)`: staging region → decode pages and scale entries.
    #[pyo3(get)]
    network: (U64s, U64s, U64s),
    /// `(src_addrs, dst_addrs, lengths)`: decode-side copies (empty: the prefill converts).
    #[pyo3(get)]
    scatter: (U64s, U64s, U64s),
    /// Per convert row: input address (gathered area).
    #[pyo3(get)]
    in_addrs: U64s,
    /// Per convert row: output address (converted area).
    #[pyo3(get)]
    out_addrs: U64s,
    /// Per convert row: elements.
    #[pyo3(get)]
    n_elems: U64s,
    /// Per convert row: input dtype code (an index into `DTYPES`).
    #[pyo3(get)]
    in_dtypes: U8s,
    /// Per convert row: output dtype code.
    #[pyo3(get)]
    out_dtypes: U8s,
    /// Per convert row: consecutive elements sharing one scale.
    #[pyo3(get)]
    group_elems: U64s,
    /// Per convert row: scale format code (an index into `SCALE_FORMATS`: float32, e8m0).
    #[pyo3(get)]
    scale_formats: U8s,
    /// Per convert row: address of its first scale (scale area).
    #[pyo3(get)]
    scale_addrs: U64s,
    /// Per convert row: decode address its scales go to (its scale entry).
    #[pyo3(get)]
    scale_dst_addrs: U64s,
    /// Bytes of the gathered area.
    #[pyo3(get)]
    gathered_bytes: u64,
    /// Bytes of the converted area.
    #[pyo3(get)]
    converted_bytes: u64,
    /// Bytes of the scale area.
    #[pyo3(get)]
    scale_bytes: u64,
    /// Bytes of the staging region used from its start.
    #[pyo3(get)]
    staging_bytes: u64,
    /// Bytes of the decode staging region used from its start (0 when the prefill converts).
    #[pyo3(get)]
    dst_staging_bytes: u64,
    /// `"prefill"` or `"decode"`: where the convert rows run.
    #[pyo3(get)]
    convert_on: &'static str,
    /// Bytes the network moves (converted values, scales, kept pairs).
    #[pyo3(get)]
    network_bytes: u64,
    /// Blocks of the direct plan in the prefill representation.
    #[pyo3(get)]
    direct_blocks: usize,
    /// Number of convert rows.
    #[pyo3(get)]
    n_rows: usize,
    /// Blocks of the gather, the network and the scatter.
    #[pyo3(get)]
    n_blocks: (usize, usize, usize),
    /// The network's columns, for its content digests.
    network_blocks: [Vec<u64>; 3],
    /// The core's stages of the plan (`ConversionPlan.stages`).
    stages: &'static [kvplan_core::Stage],
}

#[pymethods]
impl PyConversionPlan {
    /// The plan's stages in the order they run: `(kind, side, part, reads, writes)` each
    /// (the convert rows run on the side `convert_on` names).
    #[getter]
    fn stages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        crate::stages::stage_tuple(py, self.stages)
    }

    /// The content digest of the network plan read on `side` from `buffers` (numpy arrays or
    /// other C-contiguous buffers, as `TransferPlan.content_digest`): on `"src"` the staging
    /// region after the convert rows (the decode's representation: values and scales, what
    /// the decode should hold), on `"dst"` the decode's memory (what landed). The two are
    /// equal exactly when every converted byte and scale arrived at its place.
    fn content_digest(
        &self,
        py: Python<'_>,
        side: &str,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let side = crate::digest::parse_side(side)?;
        let buffers = crate::digest::Buffers::extract(py, buffers)?;
        let [src_addrs, dst_addrs, lengths] = &self.network_blocks;
        let offsets = [0, lengths.len()];
        let blocks = kvplan_core::PlanBlocks {
            src_addrs,
            dst_addrs,
            lengths,
            pair_offsets: &offsets,
        };
        let pairs = crate::digest::pair_digests(py, &blocks, side, &buffers)?;
        Ok(kvplan_core::content_digest(&pairs))
    }

    fn __repr__(&self) -> String {
        format!(
            "ConversionPlan(gather={}, rows={}, network={}, scatter={} blocks, \
             gathered_bytes={}, converted_bytes={}, scale_bytes={}, network_bytes={})",
            self.n_blocks.0,
            self.n_rows,
            self.n_blocks.1,
            self.n_blocks.2,
            self.gathered_bytes,
            self.converted_bytes,
            self.scale_bytes,
            self.network_bytes
        )
    }
}

struct PlanConversion<'t>(
    &'t ConversionTemplate,
    kvplan_core::StagingRegion,
    Option<kvplan_core::StagingRegion>,
);

impl RequestPlanner for PlanConversion<'_> {
    type Output = kvplan_core::Result<ConversionPlan>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        self.0.plan(request, self.1, self.2)
    }
}

fn columns(py: Python<'_>, plan: kvplan_core::Plan) -> (U64s, U64s, U64s) {
    let column = |v: Vec<u64>| PyArray1::from_vec(py, v).unbind();
    (
        column(plan.src_addrs),
        column(plan.dst_addrs),
        column(plan.lengths),
    )
}

#[pymethods]
impl PyConversionTemplate {
    #[new]
    #[pyo3(signature = (src_layout, dst_layout, pairing=None, *, check_dst_overlap=false, replicas_send=false, **removed_keywords))]
    fn new(
        src_layout: PyRef<'_, PyLayout>,
        dst_layout: PyRef<'_, PyLayout>,
        pairing: Option<&Bound<'_, PyAny>>,
        check_dst_overlap: bool,
        replicas_send: bool,
        removed_keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let options = template_options(
            "ConversionTemplate",
            pairing,
            removed_keywords,
            check_dst_overlap,
            replicas_send,
        )?;
        let inner = ConversionTemplate::new(&src_layout.inner, &dst_layout.inner, options)
            .map_err(to_py_err)?;
        Ok(Self { inner })
    }

    /// Whether any pair converts (else the plan moves the bytes as they are).
    #[getter]
    fn converts(&self) -> bool {
        self.inner.converts()
    }

    /// `"prefill"` (quantizing before the network) or `"decode"` (dequantizing after it).
    #[getter]
    fn convert_on(&self) -> &'static str {
        side_name(self.inner.side())
    }

    /// Plans one request (page lists, or token lists with `n_tokens`, as `Template.plan`)
    /// through the prefill staging region `staging = (addr, size)` and, when the decode
    /// converts, the decode staging region `dst_staging = (addr, size)`. A `kvplan.Request`
    /// in `src_pages` stands for the pages and token range (`plan(request, staging)`).
    #[pyo3(signature = (src_pages, dst_pages=None, staging=None, *, dst_staging=None, n_tokens=None))]
    fn plan(
        &self,
        py: Python<'_>,
        src_pages: &Bound<'_, PyAny>,
        dst_pages: Option<&Bound<'_, PyAny>>,
        staging: Option<&Bound<'_, PyAny>>,
        dst_staging: Option<&Bound<'_, PyAny>>,
        n_tokens: Option<u64>,
    ) -> PyResult<PyConversionPlan> {
        let (dst_pages, staging) = shift_after(src_pages, dst_pages, staging);
        let Some(staging) = staging else {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "ConversionTemplate.plan() needs staging=(addr, size) after the request",
            ));
        };
        let staging = crate::input::staging_arg(staging)?;
        let dst_staging = dst_staging
            .filter(|obj| !obj.is_none())
            .map(crate::input::dst_staging_arg)
            .transpose()?;
        let loose = Loose {
            n_tokens,
            ..Loose::default()
        };
        let request = RequestInput::of_args("plan", src_pages, dst_pages, loose)?;
        let region = |(addr, size): (u64, u64)| kvplan_core::StagingRegion { addr, size };
        let planner = PlanConversion(&self.inner, region(staging), dst_staging.map(region));
        let plan = request.plan(py, planner)?.map_err(to_py_err)?;
        let stages = kvplan_core::MultiStage::stages(&plan);
        let n_blocks = (
            plan.gather.lengths.len(),
            plan.network.lengths.len(),
            plan.scatter.lengths.len(),
        );
        let rows = plan.rows;
        let n_rows = rows.len();
        let network_blocks = [
            plan.network.src_addrs.clone(),
            plan.network.dst_addrs.clone(),
            plan.network.lengths.clone(),
        ];
        let u64s = |v: Vec<u64>| PyArray1::from_vec(py, v).unbind();
        let u8s = |v: Vec<u8>| PyArray1::from_vec(py, v).unbind();
        Ok(PyConversionPlan {
            network_bytes: plan.network.total_bytes,
            gather: columns(py, plan.gather),
            network: columns(py, plan.network),
            scatter: columns(py, plan.scatter),
            in_addrs: u64s(rows.in_addrs),
            out_addrs: u64s(rows.out_addrs),
            n_elems: u64s(rows.n_elems),
            in_dtypes: u8s(rows.in_dtypes),
            out_dtypes: u8s(rows.out_dtypes),
            group_elems: u64s(rows.group_elems),
            scale_formats: u8s(rows.scale_formats),
            scale_addrs: u64s(rows.scale_addrs),
            scale_dst_addrs: u64s(rows.scale_dst_addrs),
            gathered_bytes: plan.gathered_bytes,
            converted_bytes: plan.converted_bytes,
            scale_bytes: plan.scale_bytes,
            staging_bytes: plan.staging_bytes,
            dst_staging_bytes: plan.dst_staging_bytes,
            convert_on: side_name(plan.convert_on),
            direct_blocks: plan.direct_blocks,
            n_rows,
            n_blocks,
            network_blocks,
            stages,
        })
    }
}

fn side_name(side: kvplan_core::Side) -> &'static str {
    match side {
        kvplan_core::Side::Src => "prefill",
        kvplan_core::Side::Dst => "decode",
    }
}

/// The dtype names by code: `DTYPES[code]` (the codes of `ConversionPlan.in_dtypes` and
/// `out_dtypes`).
pub(crate) fn dtype_names() -> Vec<&'static str> {
    KvDtype::ALL.iter().map(|d| d.as_str()).collect()
}

/// The scale format names by code: `SCALE_FORMATS[code]` (the codes of
/// `ConversionPlan.scale_formats`).
pub(crate) fn scale_format_names() -> Vec<&'static str> {
    ScaleFormat::ALL.iter().map(|f| f.as_str()).collect()
}
