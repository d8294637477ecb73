//! The stages of a plan, in the order they run: one description that every executor reads.
//!
//! A plan is one stage (a direct plan: blocks from the prefill's memory into the decode's) or
//! several, run in a fixed order between up to four memories, named by [`Role`]:
//! - [`Role::Src`]: the prefill's KV memory; [`Role::Dst`]: the decode's KV memory;
//! - [`Role::SrcStaging`]: a prefill staging region (a staged plan's `src_staging`, a rounds
//!   plan's prefill arena, a pack buffer, a conversion plan's staging region);
//! - [`Role::DstStaging`]: the decode's staging region (a staged plan's `dst_staging`, a rounds
//!   plan's decode arena, the region a decode-side conversion receives into).
//!
//! Each multi-stage plan type says which [`PlanForm`] it has through [`MultiStage`], and a form
//! lists its [`Stage`]s: what each does ([`StageKind`]: local block copies, a row gather's
//! rows, convert rows, network blocks), which side runs it, which part of the plan holds its
//! work ([`Part`]) and which memories it reads and writes. The order of every plan's stages is
//! written here and nowhere else:
//!
//! | form | stages |
//! |---|---|
//! | direct | network `src → dst` |
//! | staged, rounds | copy on the prefill `src → src_staging` (gather); network `src_staging → dst_staging`; copy on the decode `dst_staging → dst` (scatter) |
//! | packed | copy on the prefill `src → src_staging` (gather); network `src_staging → dst` |
//! | row gather | rows on the prefill `src → src_staging`; network `src_staging → dst` |
//! | conversion on the prefill | gather; convert on the prefill `src_staging → src_staging`; network `src_staging → dst`; copy on the decode `dst → dst` (the scatter, empty) |
//! | conversion on the decode | gather; network `src_staging → dst_staging`; convert on the decode `dst_staging → dst`; copy on the decode `dst_staging → dst` (scatter of the kept pairs) |
//!
//! A rounds plan ([`crate::planners::rounds`]) runs the staged stages once per round, each
//! round's gather, network and scatter in turn. Its one round is not the staged plan itself:
//! the staged plan places a prefill PP stage's bytes in its decode slots among the other
//! stages' (the decode staging layout), a rounds plan gives every sender its own share of the
//! decode arena, so the two plans' network and scatter differ under prefill PP.

use crate::error::Side;
use crate::model::plan::Plan;
use crate::planners::convert::ConversionPlan;
use crate::planners::pack::PackedPlan;
use crate::planners::rounds::StagedRounds;
use crate::planners::staged::StagedPlan;

/// A memory a stage reads or writes (see the [`crate::planners::stages`] module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The prefill's KV memory.
    Src,
    /// A prefill staging region (staging region, prefill arena or pack buffer).
    SrcStaging,
    /// The decode's staging region (or decode arena).
    DstStaging,
    /// The decode's KV memory.
    Dst,
}

impl Role {
    /// The role's name: `src`, `src_staging`, `dst_staging` or `dst`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Src => "src",
            Role::SrcStaging => "src_staging",
            Role::DstStaging => "dst_staging",
            Role::Dst => "dst",
        }
    }
}

/// What a stage does, and which side's process runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageKind {
    /// Blocks copied inside one process (a gather or a scatter).
    Copy {
        /// The side that runs the copies.
        side: Side,
    },
    /// A row gather's rows copied into the pack buffer ([`crate::RowGather`]).
    Rows {
        /// The side that runs the row gather.
        side: Side,
    },
    /// A conversion plan's convert rows ([`crate::planners::convert::ConvertRows`]).
    Convert {
        /// The side that runs the convert rows.
        side: Side,
    },
    /// Blocks from the prefill to the decode, moved by the transfer engine.
    Network,
}

impl StageKind {
    /// The kind's name: `copy`, `rows`, `convert` or `network`.
    pub fn name(self) -> &'static str {
        match self {
            StageKind::Copy { .. } => "copy",
            StageKind::Rows { .. } => "rows",
            StageKind::Convert { .. } => "convert",
            StageKind::Network => "network",
        }
    }

    /// The side whose process runs the stage (`None`: the transfer engine).
    pub fn side(self) -> Option<Side> {
        match self {
            StageKind::Copy { side } | StageKind::Rows { side } | StageKind::Convert { side } => {
                Some(side)
            }
            StageKind::Network => None,
        }
    }
}

/// Which part of a plan holds a stage's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The plan's `gather`.
    Gather,
    /// A row gather's rows (the [`crate::RowGather`] of a row-gather plan).
    Rows,
    /// The plan's `network`.
    Network,
    /// The plan's `scatter`.
    Scatter,
    /// The plan itself: a direct plan's blocks, or a conversion plan's convert rows (its
    /// `rows`; the Python `ConversionPlan` holds them as its own columns).
    Whole,
}

impl Part {
    /// The part's attribute name (`None` for [`Part::Whole`]: the plan itself).
    pub fn name(self) -> Option<&'static str> {
        match self {
            Part::Gather => Some("gather"),
            Part::Rows => Some("rows"),
            Part::Network => Some("network"),
            Part::Scatter => Some("scatter"),
            Part::Whole => None,
        }
    }
}

/// One stage of a plan: what it does, where its work is, which memory it reads and which it
/// writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    /// What the stage does and which side runs it.
    pub kind: StageKind,
    /// The part of the plan holding the stage's work.
    pub part: Part,
    /// The memory its sources lie in.
    pub reads: Role,
    /// The memory its destinations lie in.
    pub writes: Role,
}

const fn stage(kind: StageKind, part: Part, reads: Role, writes: Role) -> Stage {
    Stage {
        kind,
        part,
        reads,
        writes,
    }
}

const GATHER: Stage = stage(
    StageKind::Copy { side: Side::Src },
    Part::Gather,
    Role::Src,
    Role::SrcStaging,
);
const DIRECT: [Stage; 1] = [stage(StageKind::Network, Part::Whole, Role::Src, Role::Dst)];
const STAGED: [Stage; 3] = [
    GATHER,
    stage(
        StageKind::Network,
        Part::Network,
        Role::SrcStaging,
        Role::DstStaging,
    ),
    stage(
        StageKind::Copy { side: Side::Dst },
        Part::Scatter,
        Role::DstStaging,
        Role::Dst,
    ),
];
const PACKED: [Stage; 2] = [
    GATHER,
    stage(
        StageKind::Network,
        Part::Network,
        Role::SrcStaging,
        Role::Dst,
    ),
];
const ROW_GATHER: [Stage; 2] = [
    stage(
        StageKind::Rows { side: Side::Src },
        Part::Rows,
        Role::Src,
        Role::SrcStaging,
    ),
    stage(
        StageKind::Network,
        Part::Network,
        Role::SrcStaging,
        Role::Dst,
    ),
];
// A prefill-side conversion's scatter is empty (the network writes the decode's pages); it is
// listed so that every part of the plan runs, reading and writing the decode's memory.
const CONVERT_ON_PREFILL: [Stage; 4] = [
    GATHER,
    stage(
        StageKind::Convert { side: Side::Src },
        Part::Whole,
        Role::SrcStaging,
        Role::SrcStaging,
    ),
    stage(
        StageKind::Network,
        Part::Network,
        Role::SrcStaging,
        Role::Dst,
    ),
    stage(
        StageKind::Copy { side: Side::Dst },
        Part::Scatter,
        Role::Dst,
        Role::Dst,
    ),
];
const CONVERT_ON_DECODE: [Stage; 4] = [
    GATHER,
    stage(
        StageKind::Network,
        Part::Network,
        Role::SrcStaging,
        Role::DstStaging,
    ),
    stage(
        StageKind::Convert { side: Side::Dst },
        Part::Whole,
        Role::DstStaging,
        Role::Dst,
    ),
    stage(
        StageKind::Copy { side: Side::Dst },
        Part::Scatter,
        Role::DstStaging,
        Role::Dst,
    ),
];

/// The forms a plan comes in, each with its stages (the table of the
/// [`crate::planners::stages`] module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanForm {
    /// One stage: a direct plan, a batch, a slice of one.
    Direct,
    /// A [`StagedPlan`].
    Staged,
    /// A [`StagedRounds`]: the staged stages, once per round.
    Rounds,
    /// A [`PackedPlan`] (gather and network).
    Packed,
    /// A row gather and the network plan out of its pack buffer
    /// ([`crate::PackPlanner::row_gather`]).
    RowGather,
    /// A [`ConversionPlan`] whose convert rows run on the given side.
    Conversion(Side),
}

impl PlanForm {
    /// Every form.
    pub const ALL: [PlanForm; 7] = [
        PlanForm::Direct,
        PlanForm::Staged,
        PlanForm::Rounds,
        PlanForm::Packed,
        PlanForm::RowGather,
        PlanForm::Conversion(Side::Src),
        PlanForm::Conversion(Side::Dst),
    ];

    /// The form's stages, in the order they run.
    pub fn stages(self) -> &'static [Stage] {
        match self {
            PlanForm::Direct => &DIRECT,
            PlanForm::Staged | PlanForm::Rounds => &STAGED,
            PlanForm::Packed => &PACKED,
            PlanForm::RowGather => &ROW_GATHER,
            PlanForm::Conversion(Side::Src) => &CONVERT_ON_PREFILL,
            PlanForm::Conversion(Side::Dst) => &CONVERT_ON_DECODE,
        }
    }

    /// The form's name: `direct`, `staged`, `rounds`, `packed`, `row_gather`,
    /// `convert_on_prefill` or `convert_on_decode`.
    pub fn name(self) -> &'static str {
        match self {
            PlanForm::Direct => "direct",
            PlanForm::Staged => "staged",
            PlanForm::Rounds => "rounds",
            PlanForm::Packed => "packed",
            PlanForm::RowGather => "row_gather",
            PlanForm::Conversion(Side::Src) => "convert_on_prefill",
            PlanForm::Conversion(Side::Dst) => "convert_on_decode",
        }
    }

    /// The form named `name` ([`PlanForm::name`]), if one is.
    pub fn named(name: &str) -> Option<PlanForm> {
        PlanForm::ALL.into_iter().find(|form| form.name() == name)
    }
}

/// A plan whose stages run in a fixed order (see the [`crate::planners::stages`] module).
pub trait MultiStage {
    /// The plan's form.
    fn form(&self) -> PlanForm;

    /// The plan's stages, in the order they run.
    fn stages(&self) -> &'static [Stage] {
        self.form().stages()
    }
}

impl MultiStage for Plan {
    fn form(&self) -> PlanForm {
        PlanForm::Direct
    }
}

impl<P> MultiStage for StagedPlan<P> {
    fn form(&self) -> PlanForm {
        PlanForm::Staged
    }
}

impl MultiStage for StagedRounds {
    fn form(&self) -> PlanForm {
        PlanForm::Rounds
    }
}

impl<G> MultiStage for PackedPlan<G> {
    fn form(&self) -> PlanForm {
        PlanForm::Packed
    }
}

impl MultiStage for ConversionPlan {
    fn form(&self) -> PlanForm {
        PlanForm::Conversion(self.convert_on)
    }
}

/// [`crate::PackPlanner::row_gather`]'s plan: the rows and the network plan.
impl MultiStage for (crate::planners::pack::RowGather, Plan) {
    fn form(&self) -> PlanForm {
        PlanForm::RowGather
    }
}
