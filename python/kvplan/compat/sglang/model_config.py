"""The model's ``config.json`` as an SGLang server was started with it: the directory
``--model-path`` names, or, for a Hugging Face hub id, the snapshot SGLang downloaded into the
local Hugging Face cache before its scheduler started. Only files are read: no network, no
``huggingface_hub`` import (its cache layout is documented and stable: ``models--ORG--NAME``
with ``refs/REVISION`` holding a commit and ``snapshots/COMMIT/config.json``).

What the drop-ins read from it: the KV heads of an MHA model whose ``kv_args`` carry none (a
decode without SGLang's hetero-TP staging) and the RoPE configuration, both for the layout
identity.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from kvplan.identity import hf_rope

__all__ = ["config_kv_heads", "config_rope", "hub_cache_dir", "model_config"]

_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_cache_dir() -> str:
    """Where the Hugging Face cache keeps hub downloads: ``HF_HUB_CACHE``, else ``HF_HOME``'s
    ``hub``, else ``XDG_CACHE_HOME``'s (or ``~/.cache``'s) ``huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "huggingface", "hub")


def _config_path(model_path: str, revision: str) -> str | None:
    if not model_path:
        return None
    if os.path.isdir(model_path):
        path = os.path.join(model_path, "config.json")
        return path if os.path.isfile(path) else None
    parts = model_path.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None  # not a hub id (ORG/NAME)
    repo = os.path.join(hub_cache_dir(), "models--" + "--".join(parts))
    commit = revision or "main"
    if not _COMMIT.fullmatch(commit):
        try:
            with open(os.path.join(repo, "refs", commit), encoding="utf-8") as f:
                commit = f.read().strip()
        except OSError:
            return None
        if not _COMMIT.fullmatch(commit):
            return None
    path = os.path.join(repo, "snapshots", commit, "config.json")
    return path if os.path.isfile(path) else None


def model_config(model_path: str, revision: str = "") -> dict[str, Any] | None:
    """The ``config.json`` of ``model_path`` (a local directory, or a hub id ``ORG/NAME`` at
    ``revision``, default ``main``, found in the local Hugging Face cache), or None when there
    is none to read."""
    path = _config_path(model_path, revision)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def config_rope(model_path: str, revision: str = "") -> Any:
    """The RoPE configuration of the model's ``config.json`` (a multimodal model's
    ``text_config`` where it has one), or None."""
    config = model_config(model_path, revision)
    if config is None:
        return None
    text = config.get("text_config")
    return hf_rope(text if isinstance(text, dict) and hf_rope(text) else config)


def config_kv_heads(model_path: str, revision: str = "") -> int | None:
    """The model's KV heads from its ``config.json`` (``num_key_value_heads``, else
    ``num_attention_heads``; a multimodal model's ``text_config`` first), or None."""
    config = model_config(model_path, revision)
    if config is None:
        return None
    text = config.get("text_config")
    for part in (text, config) if isinstance(text, dict) else (config,):
        for key in ("num_key_value_heads", "num_attention_heads"):
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
