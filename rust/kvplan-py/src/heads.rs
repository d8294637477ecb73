//! `tp_peers` and `TpPeers`: which ranks of the other side a prefill or decode rank exchanges
//! KV heads with when the two sides' TP sizes differ.

use kvplan_core::{Link, Side, TpSplit, heads_text};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::to_py_err;

/// One rank's view of the head split between a prefill and a decode TP group.
#[pyclass(frozen, name = "TpPeers", module = "kvplan._core")]
pub struct PyTpPeers {
    split: TpSplit,
    side: Side,
    rank: u32,
    /// (peer rank, link), for every peer whose heads overlap.
    links: Vec<(u32, Link)>,
}

impl PyTpPeers {
    fn link(&self, peer: u32) -> PyResult<Link> {
        let (r_p, r_d) = self.side.pick((self.rank, peer), (peer, self.rank));
        self.split.link(r_p, r_d).map_err(to_py_err)
    }

    fn elected(&self) -> Vec<u32> {
        self.links
            .iter()
            .filter(|(_, l)| matches!(l, Link::Send { .. }))
            .map(|&(p, _)| p)
            .collect()
    }
}

/// The peers of one rank. Give exactly one of `prefill_rank` and `decode_rank`.
#[pyfunction]
#[pyo3(signature = (kv_heads, prefill_tp, decode_tp, *, prefill_rank=None, decode_rank=None))]
pub fn tp_peers(
    kv_heads: u32,
    prefill_tp: u32,
    decode_tp: u32,
    prefill_rank: Option<u32>,
    decode_rank: Option<u32>,
) -> PyResult<PyTpPeers> {
    let (side, rank) = match (prefill_rank, decode_rank) {
        (Some(r), None) => (Side::Src, r),
        (None, Some(r)) => (Side::Dst, r),
        _ => {
            return Err(PyTypeError::new_err(
                "give exactly one of prefill_rank= and decode_rank=",
            ));
        }
    };
    let split = TpSplit::new(kv_heads, prefill_tp, decode_tp).map_err(to_py_err)?;
    let peers = split.peers(side, rank).map_err(to_py_err)?;
    let mut links = Vec::with_capacity(peers.len());
    for peer in peers {
        let (r_p, r_d) = side.pick((rank, peer), (peer, rank));
        links.push((peer, split.link(r_p, r_d).map_err(to_py_err)?));
    }
    Ok(PyTpPeers {
        split,
        side,
        rank,
        links,
    })
}

/// KV heads one rank holds with `kv_heads` model heads over `tp_size` ranks (the core's
/// `heads_per_rank_at`: `max(1, kv_heads // tp_size)`), for Python code that sizes a rank's
/// items before it has a layout.
#[pyfunction]
pub fn heads_per_rank(kv_heads: u32, tp_size: u32) -> u32 {
    kvplan_core::heads_per_rank_at(kv_heads, tp_size)
}

/// Whether the prefill ranks writing one decode rank's staging region hold replicas of the
/// same heads, so each fills its own share (the core's `staging_replicas_write`).
#[pyfunction]
pub fn staging_replicas_write(kv_heads: u32, prefill_tp: u32, decode_tp: u32) -> bool {
    kvplan_core::staging_replicas_write(kv_heads, prefill_tp, decode_tp)
}

#[pymethods]
impl PyTpPeers {
    /// `"prefill"` or `"decode"`: the side `rank` belongs to.
    #[getter]
    fn side(&self) -> &'static str {
        self.side.pick("prefill", "decode")
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    #[getter]
    fn kv_heads(&self) -> u32 {
        self.split.kv_heads
    }

    #[getter]
    fn prefill_tp(&self) -> u32 {
        self.split.prefill_tp
    }

    #[getter]
    fn decode_tp(&self) -> u32 {
        self.split.decode_tp
    }

    /// `(start, stop)`: the model heads this rank holds.
    #[getter]
    fn heads(&self) -> (u32, u32) {
        self.split.heads(self.side, self.rank)
    }

    /// Prefill ranks holding each head (1: heads are not replicated on the prefill side).
    #[getter]
    fn replicas(&self) -> u32 {
        self.split.holders(Side::Src)
    }

    /// Ranks of the other side whose heads overlap this rank's, elected or not: the pairs to
    /// connect and build templates for (a non-elected pair still moves sharded state).
    #[getter]
    fn peers(&self) -> Vec<u32> {
        self.links.iter().map(|&(p, _)| p).collect()
    }

    /// Decode ranks this prefill rank sends KV heads to (it is their elected sender); empty
    /// for a decode rank.
    #[getter]
    fn send_to(&self) -> Vec<u32> {
        match self.side {
            Side::Src => self.elected(),
            Side::Dst => Vec::new(),
        }
    }

    /// Prefill ranks this decode rank receives KV heads from (exactly one per head); empty for
    /// a prefill rank.
    #[getter]
    fn receive_from(&self) -> Vec<u32> {
        match self.side {
            Side::Src => Vec::new(),
            Side::Dst => self.elected(),
        }
    }

    /// A prefill rank: whether it is the elected sender for at least one decode rank. A
    /// decode rank: always False.
    #[getter]
    fn is_sender(&self) -> bool {
        self.side == Side::Src && !self.elected().is_empty()
    }

    /// `(start, stop)` of the heads that move between this rank and `peer`, or None.
    fn heads_with(&self, peer: u32) -> PyResult<Option<(u32, u32)>> {
        Ok(match self.link(peer)? {
            Link::Send { start, stop } => Some((start, stop)),
            _ => None,
        })
    }

    /// Why no KV heads move between this rank and `peer` (None when they do).
    fn reason(&self, peer: u32) -> PyResult<Option<String>> {
        let (r_p, r_d) = self.side.pick((self.rank, peer), (peer, self.rank));
        Ok(self.link(peer)?.reason(r_p, r_d, &self.split))
    }

    /// In words: `decode rank 1 of TP 2 (heads 4–7) gathers heads 4–7 from prefill ranks 4–7`.
    fn __str__(&self) -> String {
        let (start, stop) = self.split.heads(self.side, self.rank);
        let moved: Vec<(u32, u32, u32)> = self
            .links
            .iter()
            .filter_map(|&(peer, link)| match link {
                Link::Send { start, stop } => Some((peer, start, stop)),
                _ => None,
            })
            .collect();
        let me = format!(
            "{} rank {} of TP {} ({})",
            self.side(),
            self.rank,
            self.split.tp(self.side),
            heads_text(start, stop)
        );
        let other = self.side.pick("decode", "prefill");
        let Some(&(_, first, _)) = moved.first() else {
            return format!(
                "{me} {} no KV heads: another replica is elected",
                self.side.pick("sends", "receives")
            );
        };
        let last = moved.iter().map(|m| m.2).max().unwrap_or(first);
        let ranks: Vec<u32> = moved.iter().map(|m| m.0).collect();
        let verb = match (self.side, moved.len()) {
            (Side::Src, 1) => "sends",
            (Side::Src, _) => "scatters",
            (Side::Dst, 1) => "receives",
            (Side::Dst, _) => "gathers",
        };
        let dir = self.side.pick("to", "from");
        let mut text = format!(
            "{me} {verb} {} {dir} {other} {}",
            heads_text(first, last),
            ranks_text(&ranks)
        );
        if self.split.holders(Side::Src) > 1 {
            text.push_str(" (each head is held by ");
            text.push_str(&self.split.holders(Side::Src).to_string());
            text.push_str(" prefill ranks; one elected sender per decode rank)");
        }
        text
    }

    fn __repr__(&self) -> String {
        format!(
            "TpPeers(side={:?}, rank={}, heads={:?}, peers={:?}, send_to={:?}, receive_from={:?})",
            self.side(),
            self.rank,
            self.heads(),
            self.peers(),
            self.send_to(),
            self.receive_from()
        )
    }
}

/// `rank 3`, `ranks 4–7`, `ranks 0, 2`.
fn ranks_text(ranks: &[u32]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        [first, .., last] if ranks.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("ranks {first}–{last}")
        }
        _ => {
            let list: Vec<String> = ranks.iter().map(ToString::to_string).collect();
            format!("ranks {}", list.join(", "))
        }
    }
}
