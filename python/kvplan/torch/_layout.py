"""A :class:`kvplan.Layout` read from an engine's KV cache tensors (addresses, sizes, strides)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvplan import Layout, LayoutError

__all__ = ["layout_from_tensors"]

#: Dimension names with a meaning of their own; any other name is a dimension inside an item
#: (``"dim"`` for the head dimension, ``"latent"``, ...).
_OUTER = ("page", "kv", "layer")
#: Keywords the tensors decide: passing them as well could only disagree.
_DERIVED = ("strides", "roles", "kinds", "drafts", "device")


@dataclass(frozen=True)
class _Entry:
    role: str
    layer: int  # position of the entry's layer in the caller's layer order
    data_ptr: int
    data_len: int
    item_len: int
    stride: int


@dataclass(frozen=True)
class _Geometry:
    page_size: int
    heads: int
    head_dim: int
    dtype_size: int
    memory_order: str


def _fail(message: str) -> LayoutError:
    err = LayoutError(message)
    err.kind = "tensor_layout"
    return err


def _dims(dims: str | Sequence[str]) -> list[str]:
    names = dims.split() if isinstance(dims, str) else [str(d) for d in dims]
    repeated = sorted({d for d in names if names.count(d) > 1})
    if repeated:
        raise _fail(f"dims {names}: {', '.join(repeated)} named more than once")
    if "page" not in names and "token" not in names:
        raise _fail(
            f"dims {names} name neither a 'page' nor a 'token' dimension: the pages "
            "of a tensor cannot be told from its shape"
        )
    return names


class _Tensor:
    """One tensor of the call, read with its dimension names."""

    def __init__(
        self, name: str, tensor: torch.Tensor, dims: list[str], page_size: int | None
    ) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} is a {type(tensor).__name__}, not a torch.Tensor")
        self.name, self.tensor = name, tensor
        self.shape, self.strides = tuple(tensor.shape), tuple(tensor.stride())
        if len(dims) != tensor.dim():
            raise _fail(
                f"{self.what()} has {tensor.dim()} dimensions, dims names {len(dims)}: {dims}"
            )
        self.element = tensor.element_size()
        size = dict(zip(dims, self.shape))
        stride = dict(zip(dims, self.strides))
        self.size, self.stride = size, stride
        if "kv" in size and size["kv"] != 2:
            raise _fail(f"{self.what()}: its 'kv' dimension has size {size['kv']}, not 2 (K, V)")
        flat_pool = "page" not in size
        item_dims = [d for d in dims if d not in _OUTER]
        if flat_pool and item_dims[0] != "token":
            raise _fail(
                f"{self.what()}: without a 'page' dimension a page is page_size "
                f"consecutive tokens, so 'token' must be the outermost of the item's "
                f"dimensions {item_dims}"
            )
        self._check_dense(item_dims)
        row = math.prod(size[d] for d in item_dims if d != "token" or not flat_pool)
        if flat_pool:
            if page_size is None:
                raise _fail(
                    f"{self.what()} has no 'page' dimension: give page_size (tokens per page)"
                )
            self.page_size = page_size
            self.item_len = page_size * row * self.element
            self.page_stride = self.item_len
            self.pages = size["token"] // page_size
            # The whole token pool: the core counts its whole pages (a partial last page of
            # tokens holds no page).
            self.extent = size["token"] * row * self.element
        else:
            tokens = size.get("token")
            if tokens is None and page_size is None:
                raise _fail(
                    f"{self.what()} has no 'token' dimension: give page_size (tokens per page)"
                )
            if tokens is not None and page_size is not None and tokens != page_size:
                raise _fail(
                    f"{self.what()}: page_size={page_size} was given, but its 'token' "
                    f"dimension holds {tokens} tokens per page"
                )
            self.page_size = tokens if tokens is not None else int(page_size or 0)
            self.item_len = row * self.element
            self.page_stride = stride["page"] * self.element
            self.pages = size["page"]
            self.extent = self.item_len
        self._check_nested([d for d in dims if d in _OUTER])
        order = [d for d in item_dims if d in ("token", "head")]
        heads = size.get("head", 1)
        head_bytes = math.prod(size[d] for d in item_dims if d not in ("token", "head"))
        self.geometry = _Geometry(
            self.page_size,
            heads,
            head_bytes,
            self.element,
            "HND" if order[:1] == ["head"] and "token" in order else "NHD",
        )

    def what(self) -> str:
        return f"{self.name} (shape {self.shape}, strides {self.strides})"

    def _check_dense(self, item_dims: list[str]) -> None:
        """An item is one address range only if its dimensions are row-major without gaps."""
        expected = 1
        for d in reversed(item_dims):
            if self.size[d] != 1 and self.stride[d] != expected:
                raise _fail(
                    f"{self.what()} is not contiguous the way a layout needs: "
                    f"dimension {d!r} has stride {self.stride[d]}, {expected} expected "
                    f"for items of dimensions {item_dims} stored row-major without "
                    "gaps (strides in elements)"
                )
            expected *= self.size[d]

    def _check_nested(self, outer: list[str]) -> None:
        """The page, K/V and layer dimensions place whole items side by side: each, by
        increasing stride, must step past everything the smaller ones span (padding allowed),
        else two entries or pages would share bytes."""
        extent = self.extent
        for d in sorted((d for d in outer if self.size[d] > 1), key=lambda d: self.stride[d]):
            step = self.stride[d] * self.element
            if step < extent:
                raise _fail(
                    f"{self.what()}: dimension {d!r} steps {step} bytes, less than the "
                    f"{extent} bytes of the items inside one step, so items would "
                    "overlap"
                )
            extent += (self.size[d] - 1) * step

    def entries(self, role: str | None, first_layer: int) -> list[list[_Entry]]:
        """Per K/V plane (one, or K then V), the entries of every layer the tensor holds."""
        layers = self.size.get("layer", 1)
        planes = [role or "kv"] if "kv" not in self.size else ["k", "v"]
        data_len = 0 if self.pages == 0 else (self.pages - 1) * self.page_stride + self.item_len
        if "page" not in self.size:
            data_len = self.extent
        base = int(self.tensor.data_ptr())
        out = []
        for plane, plane_role in enumerate(planes):
            row = []
            for layer in range(layers):
                offset = layer * self.stride.get("layer", 0) + plane * self.stride.get("kv", 0)
                row.append(
                    _Entry(
                        plane_role,
                        first_layer + layer,
                        base + offset * self.element,
                        data_len,
                        self.item_len,
                        self.page_stride,
                    )
                )
            out.append(row)
        return out


def layout_from_tensors(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    dims: str | Sequence[str],
    *,
    v_tensors: Sequence[torch.Tensor] | None = None,
    layer_ids: Sequence[int] | None = None,
    page_size: int | None = None,
    names: Sequence[str] | None = None,
    **context: object,
) -> Layout:
    """A :class:`kvplan.Layout` of an engine's KV cache tensors, every address, size and stride
    read from the tensors.

    ``dims`` names each dimension of the tensors (a space-separated string or a sequence):
    ``"page"`` (page or block index), ``"token"`` (token slot in a page; without a ``"page"``
    dimension, the token index of a token pool cut into pages of ``page_size`` tokens),
    ``"head"`` (KV head), ``"kv"`` (size 2: K then V), ``"layer"`` (a cross-layer pool's layer
    index); every other name is a dimension inside an item (e.g. ``"dim"``). Examples:

    - vLLM, one tensor per layer: ``layout_from_tensors(kv_caches, "kv page token head dim")``
      for ``[2, num_blocks, block_size, heads, head_dim]``; ``"page kv token head dim"`` for
      ``[num_blocks, 2, ...]``; ``"page kv head token dim"`` for head-major (HND) pages; MLA
      ``[num_blocks, block_size, latent]``: ``"page token latent"``.
    - SGLang, per-layer K and V token buffers ``[tokens, heads, head_dim]``:
      ``layout_from_tensors(k_buffers, "token head dim", v_tensors=v_buffers, page_size=P)``.
    - A cross-layer pool ``[num_blocks, layers, 2, block_size, heads, head_dim]``:
      ``layout_from_tensors(pool, "page layer kv token head dim")``.

    Entries are in the order of the named constructors: per-layer tensors as ``Layout.mha``
    (every K entry, then every V entry; roles ``k`` / ``v``) or ``Layout.mla`` (one ``kv`` entry
    per layer); a pool with a ``"layer"`` dimension as ``Layout.cross_layer`` (layer by layer,
    K then V). ``layer_ids`` (default None: not published) gives one global id per layer:
    per tensor, or per position of the ``"layer"`` dimensions. An item is a page of one entry:
    its dimensions (all but page, kv and layer) must be row-major without gaps; the page, kv
    and layer dimensions may be in any order and padded, but must not make items overlap.
    Tokens per page come from the ``"token"`` dimension (``page_size`` must agree with it when
    given); without one, ``page_size`` is required. ``device`` is the tensors' (one for all).

    ``context`` is the keyword context of ``Layout`` (``tp_rank``, ``tp_size``, ``pp_rank``,
    ``dcp_size``, ``kv_heads``, ...). With ``kv_heads`` (the whole model's KV heads, which one
    rank's tensors cannot show) the attention geometry is read from the tensors too:
    ``heads_per_rank`` (the ``"head"`` dimension, 1 without one), ``head_dim`` (elements of one
    head's token), ``dtype_size`` and ``memory_order`` (``"HND"`` when heads are outside tokens
    in an item); a value also given in ``context`` must agree.

    Raises:
        LayoutError: A tensor that is not laid out as ``dims`` says a layout needs (the message
            names the tensor, its shape and strides), tensors on different devices or with
            different page sizes, ``layer_ids`` of the wrong length, a given keyword that
            disagrees with the tensors; and whatever ``Layout`` raises.
        TypeError: A tensor that is not a ``torch.Tensor``; a keyword the tensors decide
            (``strides``, ``roles``, ``kinds``, ``drafts``, ``device``).
    """
    derived = sorted(k for k in context if k in _DERIVED)
    if derived:
        raise TypeError(
            f"layout_from_tensors reads {', '.join(derived)} from the tensors; do not pass them"
        )
    names_of = _dims(dims)
    k_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    v_list = None if v_tensors is None else list(v_tensors)
    if not k_list:
        raise _fail("layout_from_tensors needs at least one tensor")
    if v_list is not None:
        if "kv" in names_of:
            raise _fail(
                "v_tensors given with a 'kv' dimension: K and V are either one tensor's "
                "'kv' dimension or two lists"
            )
        if "layer" in names_of:
            raise _fail(
                "v_tensors given with a 'layer' dimension: a cross-layer pool holds K "
                "and V in one tensor (name its 'kv' dimension)"
            )
        if len(v_list) != len(k_list):
            raise _fail(f"{len(k_list)} K tensors and {len(v_list)} V tensors")
    given = list(names) if names is not None else None
    n_all = len(k_list) + (len(v_list) if v_list is not None else 0)
    if given is not None and len(given) != n_all:
        raise _fail(f"{len(given)} names for {n_all} tensors")

    def label(i: int, v: bool) -> str:
        if given is not None:
            return given[i + (len(k_list) if v else 0)]
        return f"{'v_tensors' if v else 'tensors'}[{i}]"

    k_read = [_Tensor(label(i, False), t, names_of, page_size) for i, t in enumerate(k_list)]
    v_read = (
        []
        if v_list is None
        else [_Tensor(label(i, True), t, names_of, page_size) for i, t in enumerate(v_list)]
    )
    every = k_read + v_read
    first = every[0]
    for t in every[1:]:
        if t.tensor.device != first.tensor.device:
            raise _fail(
                f"{t.what()} is on {t.tensor.device}, {first.what()} on "
                f"{first.tensor.device}: a layout describes one device's memory"
            )
        if t.page_size != first.page_size:
            raise _fail(
                f"{t.what()} holds {t.page_size} tokens per page, {first.what()} {first.page_size}"
            )
    # Layer positions: one per tensor, or one per position of each tensor's layer dimension.
    starts, n_layers = [], 0
    for t in k_read:
        starts.append(n_layers)
        n_layers += t.size.get("layer", 1)
    if layer_ids is not None and len(layer_ids) != n_layers:
        raise _fail(
            f"{len(layer_ids)} layer ids for {n_layers} layers (one per "
            f"{'position of the layer dimension' if 'layer' in names_of else 'tensor'})"
        )
    entries: list[_Entry] = []
    if "layer" in names_of:  # Layout.cross_layer's order: layer by layer, K then V
        for t, start in zip(k_read, starts):
            planes = t.entries(None, start)
            entries += [
                planes[p][layer] for layer in range(len(planes[0])) for p in range(len(planes))
            ]
    else:  # Layout.mha's order: every K entry, then every V entry
        k_role = None if v_list is None else "k"
        k_planes = [t.entries(k_role, start) for t, start in zip(k_read, starts)]
        for plane in range(len(k_planes[0])):
            entries += [e for planes in k_planes for e in planes[plane]]
        entries += [e for t, start in zip(v_read, starts) for e in t.entries("v", start)[0]]
    if "kv_heads" in context:
        geometry = first.geometry
        for t in every[1:]:
            if t.geometry != geometry:
                raise _fail(
                    f"{t.what()} has attention geometry {t.geometry}, {first.what()} {geometry}"
                )
        read = {
            "heads_per_rank": geometry.heads,
            "head_dim": geometry.head_dim,
            "dtype_size": geometry.dtype_size,
            "memory_order": geometry.memory_order,
        }
        for key, value in read.items():
            if key in context and context[key] is not None and context[key] != value:
                raise _fail(
                    f"{key}={context[key]!r} was given, but the tensors hold "
                    f"{value!r} ({first.what()})"
                )
            context[key] = value
    ids = None if layer_ids is None else [int(layer_ids[e.layer]) for e in entries]
    # Layout's keywords are typed one by one; the caller's are checked by Layout itself.
    keywords: dict[str, Any] = dict(context)
    return Layout(
        [e.data_ptr for e in entries],
        [e.data_len for e in entries],
        [e.item_len for e in entries],
        ids,
        [e.role for e in entries],
        strides=[e.stride for e in entries],
        page_size=first.page_size,
        device=str(first.tensor.device),
        **keywords,
    )
