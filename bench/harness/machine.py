"""The machine and software a benchmark ran on, for the header of its results."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np

from . import REPO


def sh(cmd: str) -> str:
    """A shell command's output, stripped; empty if it cannot run."""
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception:
        return ""


def lscpu() -> dict[str, str]:
    """``lscpu``'s fields (empty where it is missing)."""
    fields = {}
    for line in sh("lscpu").splitlines():
        if ":" in line:
            name, value = line.split(":", 1)
            fields.setdefault(name, value.strip())
    return fields


def commit() -> str:
    """The checkout's short commit, with a note when rust/ or python/ has uncommitted changes."""
    head = sh(f"git -C {REPO} rev-parse --short HEAD")
    dirty = sh(f"git -C {REPO} status --porcelain -- rust python")
    return head + (" (+ uncommitted changes)" if dirty else "")


def describe(load_start: float, kvplan_version: str, *, sglang_version: str | None = None
             ) -> list[str]:
    """A Markdown bullet list: CPU and RAM, OS, Python and numpy, kvplan (and SGLang) versions
    and commit, and the load average at the start and now (other work on the machine)."""
    cpu = lscpu()

    def field(name: str) -> str:
        return cpu.get(name, "?")

    mem = sh("free -g | awk '/Mem:/{print $2}'")
    sglang = f"SGLang {sglang_version} (PyPI wheel, `--no-deps`), " if sglang_version else ""
    return [
        f"- CPU: {field('Model name')}, {field('CPU(s)')} CPU(s), {field('Thread(s) per core')} "
        f"thread(s) per core, {field('Hypervisor vendor')} guest; L1d {field('L1d cache')}, "
        f"L2 {field('L2 cache')}, L3 {field('L3 cache')}; RAM {mem} GiB",
        f"- OS: {platform.platform()} (`uname -r` {platform.release()})",
        f"- Python {platform.python_version()} ({sys.executable}), numpy {np.__version__}",
        f"- {sglang}kvplan {kvplan_version} at commit {commit()}",
        f"- load average (1 min): {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
        f"end (2 shared cores; other sessions' work shows up here)",
    ]


def summary() -> str:
    """One line for a results table's header: Python, architecture, CPUs and CPU model."""
    model = lscpu().get("Model name", "?")
    return (f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs "
            f"({model})")
