"""The model's ``config.json`` as SGLang's drop-ins read it: a local directory's, or a hub id's
snapshot in the local Hugging Face cache (files only, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.compat.sglang.model_config import (
    config_kv_heads,
    config_rope,
    hub_cache_dir,
    model_config,
)

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    repo = cache / "models--org--name"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT + "\n")
    (repo / "snapshots" / COMMIT / "config.json").write_text(json.dumps({
        "num_attention_heads": 16,
        "text_config": {"num_key_value_heads": 4,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                        "rope_theta": 10000.0}}))
    return cache


def test_cache_dir_follows_the_hugging_face_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert hub_cache_dir() == "/x/huggingface/hub"
    monkeypatch.setenv("HF_HOME", "/h")
    assert hub_cache_dir() == "/h/hub"
    monkeypatch.setenv("HF_HUB_CACHE", "/c")
    assert hub_cache_dir() == "/c"


def test_a_hub_id_reads_its_cached_snapshot(hub: Path) -> None:
    assert config_kv_heads("org/name") == 4  # text_config first
    assert config_kv_heads("org/name", COMMIT) == 4
    rope = config_rope("org/name")
    assert rope is not None and "yarn" in json.dumps(rope)


@pytest.mark.parametrize("model_path, revision", [
    ("org/name", "v2"),            # a revision the cache does not hold
    ("org/other", ""),             # a model the cache does not hold
    ("../name", ""),               # not ORG/NAME
    ("org/..", ""),
    ("name", ""),
    ("", ""),
    ("org/name", "../../etc"),     # a ref outside refs/ is never read as a commit
])
def test_what_is_not_in_the_cache_is_none(hub: Path, model_path: str, revision: str) -> None:
    assert model_config(model_path, revision) is None
    assert config_kv_heads(model_path, revision) is None


def test_a_ref_that_is_not_a_commit_is_none(hub: Path) -> None:
    (hub / "models--org--name" / "refs" / "main").write_text("not-a-commit")
    assert model_config("org/name") is None


def test_a_local_directory_is_read_first(tmp_path: Path, hub: Path) -> None:
    local = tmp_path / "weights"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"num_key_value_heads": 2}))
    assert config_kv_heads(str(local)) == 2
    (local / "config.json").write_text("{not json")
    assert model_config(str(local)) is None
