"""Real SGLang 0.5.23 prefill/decode servers on this CPU machine, with SGLang's and kvplan's KV
managers, Mooncake TCP on loopback.

Entry point: ``bash scripts/e2e-sglang`` (docs/sglang.md, "End to end in real SGLang servers").
Set-up (cached venv, kvplan built from this checkout, tiny models) runs in the host's network;
the servers run in a private network namespace when root, under the machine-wide server lock.
Each case prints one line; the run ends with ``N passed, M failed`` and exits non-zero on any
failure, including a set-up that cannot complete.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as harness  # noqa: E402
import sglang_race as race  # noqa: E402
import sglang_staged_case as staged_case  # noqa: E402
from e2e_harness import (  # noqa: E402
    HttpError, Results, Server, SetupError, TinyModel, TinyQwen3Next, Venv, log)

SGLANG = "sglang==0.5.23"
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
ROUTER = "sglang-router==0.3.2"
# NIXL for `--disaggregation-transfer-backend nixl`: the `nixl` meta package loads the build for
# torch's CUDA major (13 here); its newest release with cp311 wheels is 1.5.1. Installed beside
# the venv (on the NIXL servers' PYTHONPATH only) so that the Mooncake servers run exactly the
# venv they always ran, and adding NIXL does not rebuild it.
NIXL = ("nixl==1.5.1", "nixl-cu13==1.5.1")
# SGLang's requirements that run only with CUDA (kernels, CUDA bindings, GPU memory tools) or
# only for its audio/video/vision models; every other requirement of its wheel is installed.
CUDA_ONLY = {
    "flash-attn-4", "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl", "nvidia-mathdx",
    "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "tilelang",
    "torchaudio", "torchcodec", "timm", "cuda-python", "torch-memory-saver", "av", "decord2",
}
CPU_SUPPORT = Path(__file__).resolve().parent / "sglang_cpu_support"

# The weights the decode and the plain server run; another seed for the negative control's
# prefill; the same weights with half the layers for the mismatched decode.
MODEL_A = TinyModel("llama-a", seed=0)
MODEL_B = TinyModel("llama-b", seed=1)
MODEL_A_2_LAYERS = TinyModel("llama-a-2layers", seed=0, num_layers=2)
# A linear-attention hybrid: layers 0-2 gated delta net (per-request conv and recurrent state,
# which PD transfers as Mamba state), layer 3 full attention (KV pages).
MODEL_HYBRID = TinyQwen3Next("qwen3-next-a", seed=0)

#: The name every server of an architecture serves its model under (``--served-model-name``).
SERVED_NAMES = {TinyModel.ARCH: "tiny-llama", TinyQwen3Next.ARCH: "tiny-qwen3-next"}
#: The identity case's prefill: model ``a``'s weights and shapes served under another name, as
#: a rolling update's new revision would be.
RENAMED = "tiny-llama-next"

PROMPT_LENGTHS = (1, 5, 16, 17, 64, 250)
MAX_NEW_TOKENS = 12
READY_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 180.0


# --------------------------------------------------------------------------------------------
# Set-up (host network)


def python311() -> str:
    """SGLang 0.5.23 ships cp311 wheels only."""
    chosen = os.environ.get("KVPLAN_E2E_PYTHON") or shutil.which("python3.11")
    if not chosen:
        raise SetupError("SGLang 0.5.23 needs Python 3.11 (cp311 wheels only): no python3.11 on "
                         "PATH; set KVPLAN_E2E_PYTHON to one")
    return chosen


def setup_venv() -> Venv:
    py = python311()
    root = harness.cache_root()
    wheel = harness.download_wheel(SGLANG, root / "wheels", python=py)
    deps = harness.wheel_requirements(wheel, drop=lambda name: name in CUDA_ONLY, replace={})
    venv = Venv(root / "venv-sglang-0.5.23", python=py, steps=[
        ["--no-deps", str(wheel)],
        [*deps, MOONCAKE, ROUTER],
    ])
    return venv.ensure()


def setup_nixl(venv: Venv) -> Path:
    """NIXL and its UCX plugin in a folder of their own (``pip install --target``, no
    dependencies: torch and numpy are the venv's), kept while its recipe is unchanged."""
    target = harness.cache_root() / "nixl-1.5.1-cp311"
    marker = target / ".kvplan-e2e-ready"
    recipe = " ".join(NIXL)
    if marker.is_file() and marker.read_text().strip() == recipe:
        log(f"reusing NIXL {target}")
        return target
    if target.exists():
        shutil.rmtree(target)
    harness.run([venv.py, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar",
                 "off", "--no-deps", "--only-binary", ":all:", "--target", target, *NIXL])
    marker.write_text(recipe + "\n")
    return target


@dataclass
class Prepared:
    venv: str
    models: dict[str, str]
    nixl: str = ""

    def to_json(self) -> str:
        return json.dumps({"venv": self.venv, "models": self.models, "nixl": self.nixl})

    @classmethod
    def from_json(cls, text: str) -> Prepared:
        data = json.loads(text)
        return cls(venv=data["venv"], models=data["models"], nixl=data.get("nixl", ""))


def prepare() -> Prepared:
    venv = setup_venv()
    where = harness.install_checkout(venv)
    log(f"kvplan from the checkout: {where}")
    # The hook the e2e relies on is part of the wheel just installed.
    harness.run([venv.py, "-c", "import sys, sysconfig, pathlib; "
                 "p = pathlib.Path(sysconfig.get_paths()['purelib']) / 'kvplan-sglang-install.pth';"
                 " sys.exit(0 if p.is_file() else f'{p} missing from the installed wheel')"],
                quiet=True)
    built = harness.build_tiny_models(venv, {m.name: m for m in (MODEL_A, MODEL_B,
                                                                  MODEL_A_2_LAYERS,
                                                                  MODEL_HYBRID)})
    # The hybrid model's linear-attention layers run on the CPU stand-in's gated-delta-net ops;
    # their state semantics are what a decode continues from, so check them before any server.
    log(harness.run([venv.py, "-c", "import sgl_kernel.mamba as m; print(m.self_check())"],
                    env=dict(os.environ, PYTHONPATH=str(CPU_SUPPORT)), quiet=True).strip())
    nixl = setup_nixl(venv)
    return Prepared(venv=str(venv.path), models={k: str(v) for k, v in built.items()},
                    nixl=str(nixl))


# --------------------------------------------------------------------------------------------
# Servers (inside the private network namespace)


class Ports:
    """Ports handed out in order; inside the private namespace nothing else binds them."""

    def __init__(self, start: int = 31000) -> None:
        self._next = start

    def take(self) -> int:
        self._next += 1
        return self._next


@dataclass
class SGLangServer(Server):
    """A server; a prefill also has the port of its bootstrap server."""

    bootstrap_port: int | None = None
    kvplan: bool = False  # started with kvplan installed in its schedulers
    backend: str = "mooncake"  # its --disaggregation-transfer-backend


@dataclass
class Engine:
    venv: Path
    models: dict[str, str]
    log_dir: Path
    ports: Ports
    nixl: Path | None = None  # the folder NIXL is installed in
    suffix: str = ""  # added to every server's name (a group's second run: "-retry")
    made: list[Server] = field(default_factory=list)  # every server made, in order

    def retrying(self) -> Engine:
        """The same engine for a group's second run: its servers' names end in ``-retry``;
        the ports and the list of servers made are shared, so every server is new."""
        return dataclasses.replace(self, suffix="-retry")

    def env(self, *, kvplan: bool, backend: str = "mooncake") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KVPLAN_SGLANG"))}
        env.update({
            "PYTHONPATH": str(CPU_SUPPORT),  # the host engine's CPU support, never kvplan
            "SGLANG_USE_CPU_ENGINE": "1",
            "SGLANG_HOST_IP": "127.0.0.1",
            "MOONCAKE_PROTOCOL": "tcp",
            "MC_FORCE_TCP": "1",
            # Every library thread pool at one thread: three servers share two cores.
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "NUMBA_NUM_THREADS": "1",
            "RAYON_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "KMP_BLOCKTIME": "0",
            "OMP_WAIT_POLICY": "PASSIVE",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        })
        if kvplan:
            env["KVPLAN_SGLANG_INSTALL"] = "1"
        if backend == "nixl":
            if self.nixl is None:
                raise SetupError("a NIXL server without NIXL installed")
            env["PYTHONPATH"] += os.pathsep + str(self.nixl)
            # UCX over loopback TCP only: no InfiniBand, no GPU transports in the namespace.
            env.update(UCX_NET_DEVICES="lo", UCX_TLS="tcp,self")
        return env

    def server(self, name: str, model: TinyModel | TinyQwen3Next, *, page_size: int,
               mode: str | None = None, kvplan: bool = False, pp_size: int = 1,
               backend: str = "mooncake", served_name: str | None = None) -> SGLangServer:
        name += self.suffix
        port = self.ports.take()
        # One served name per architecture, as a deployment serves one model under one name:
        # kvplan's identity check compares it (the weights' folders differ between the
        # negative control's prefill and its decode, a name does not).
        served = served_name or SERVED_NAMES[model.ARCH]
        argv = [str(self.venv / "bin" / "python"), "-m", "sglang.launch_server",
                "--model-path", self.models[model.name], "--served-model-name", served,
                "--host", "127.0.0.1",
                "--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
                "--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "1024",
                "--disable-cuda-graph", "--random-seed", "0", "--disable-radix-cache",
                "--page-size", str(page_size), "--log-level", "info"]
        if isinstance(model, TinyQwen3Next):
            # State slots (one conv + one recurrent state per request and GDN layer): SGLang's
            # default sizes them from free memory (about 4 GB here), which costs RAM and
            # start-up time; a few requests at a time need a few slots.
            argv += ["--max-mamba-cache-size", "64", "--max-running-requests", "32"]
        if pp_size > 1:
            # Pipeline stages as processes on the CPU (gloo); each holds its own layers.
            argv += ["--pp-size", str(pp_size)]
        server = SGLangServer(name=name, argv=argv, port=port,
                              env=self.env(kvplan=kvplan, backend=backend),
                              log_dir=self.log_dir, ready_path="/health", kvplan=kvplan,
                              backend=backend)
        if mode is not None:
            argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend",
                     backend]
        if mode == "prefill":
            # /metrics: SGLang's own per-request KV transfer latency (sglang:kv_transfer_*),
            # and kvplan's planned blocks per transfer call (kvplan:blocks_per_request).
            argv.append("--enable-metrics")
            server.bootstrap_port = self.ports.take()
            argv += ["--disaggregation-bootstrap-port", str(server.bootstrap_port)]
        if mode == "decode":
            # The default backup (host_pool) registers host memory with CUDA at start-up.
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        self.made.append(server)
        return server

    def router(self, name: str, prefill: SGLangServer, decode: SGLangServer, *,
               mini_lb: bool) -> Server:
        port = self.ports.take()
        argv = [str(self.venv / "bin" / "python"), "-m",
                "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill.url, str(prefill.bootstrap_port),
                "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port)]
        if mini_lb:
            argv.append("--mini-lb")
        server = Server(name=name + self.suffix, argv=argv, port=port,
                        env=self.env(kvplan=False), log_dir=self.log_dir, ready_path="/health")
        self.made.append(server)
        return server


# --------------------------------------------------------------------------------------------
# Requests


def prompts(vocab: int = MODEL_A.vocab) -> list[list[int]]:
    rng = random.Random(20261201)
    # Ids 0-2 are the tokenizer's special tokens.
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def generate_body(input_ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    return {"input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}}


def output_ids(response: dict[str, Any]) -> list[int]:
    ids = response.get("output_ids")
    if not isinstance(ids, list):
        raise AssertionError(f"no output_ids in {json.dumps(response)[:300]}")
    return [int(t) for t in ids]


def plain_generate(server: Server, ids: Sequence[int], n: int = MAX_NEW_TOKENS) -> list[int]:
    return output_ids(harness.http_json(server.url + "/generate", generate_body(ids, n),
                                        timeout_s=REQUEST_TIMEOUT_S))


_rooms = random.Random(7)


def pd_generate(prefill: SGLangServer, decode: SGLangServer, ids: Sequence[int],
                n: int = MAX_NEW_TOKENS) -> tuple[dict[str, Any], Any]:
    """Post one request to the prefill and the decode at once (what SGLang's load balancers do);
    returns the decode's response and the prefill's (or the exception each raised). Gives up
    with :class:`sglang_race.TransferThreadDied` once the prefill's log shows its transfer
    thread dead of SGLang's race (the request would only wait out its timeout)."""
    body = generate_body(ids, n)
    body.update(bootstrap_host="127.0.0.1",
                bootstrap_port=prefill.bootstrap_port,
                bootstrap_room=_rooms.randrange(1, 2**62))
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        fut_p = pool.submit(harness.http_json, prefill.url + "/generate", body, REQUEST_TIMEOUT_S)
        fut_d = pool.submit(harness.http_json, decode.url + "/generate", body, REQUEST_TIMEOUT_S)
        race.wait_watching([fut_d, fut_p], [prefill.log_path])
    finally:
        pool.shutdown(wait=False)  # given up: the requests end when the servers stop
    d = fut_d.result()
    try:
        p: Any = fut_p.result()
    except Exception as exc:  # the prefill's answer only matters for the failure case
        p = exc
    return d, p


def routed_generate(router: Server, prefill: SGLangServer, ids: Sequence[int],
                    n: int = MAX_NEW_TOKENS) -> list[int]:
    """One request through ``router``; gives up like :func:`pd_generate` once ``prefill``'s
    transfer thread is dead of SGLang's race."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        answer = pool.submit(plain_generate, router, ids, n)
        race.wait_watching([answer], [prefill.log_path])
    finally:
        pool.shutdown(wait=False)
    return answer.result()


def transfer_metrics(prefill: SGLangServer) -> dict[str, float]:
    """The prefill's cumulative ``sglang:kv_transfer_latency_ms`` sum and request count, and
    kvplan's series (absent, so 0, with SGLang's own manager): the
    transfer calls kvplan planned, their blocks and planning seconds, from its Prometheus
    ``/metrics``."""
    wanted = {"sglang:kv_transfer_latency_ms_sum": "latency_ms",
              "sglang:kv_transfer_latency_ms_count": "requests",
              "kvplan:blocks_per_request_count": "kvplan_calls",
              "kvplan:blocks_per_request_sum": "kvplan_blocks",
              "kvplan:plan_time_seconds_sum": "kvplan_plan_s"}
    got = {v: 0.0 for v in wanted.values()}
    for line in harness.http_text(prefill.url + "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            got[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return got


def compare_all(name: str, results: Results, reference: list[list[int]],
                run: Callable[[list[int]], list[int]],
                prefill: SGLangServer | None = None, *, planned_per_call: bool = True) -> None:
    """One case: every prompt through ``run`` gives the plain server's tokens. With the
    ``prefill``, the detail adds SGLang's own transfer metrics for the case's requests, and a
    prefill with kvplan must count transfer calls planned by kvplan unless
    ``planned_per_call`` is False (SGLang's NIXL manager sends equal-TP KV through the lists it
    prepared per peer, which kvplan builds at registration: no call is planned per request)."""

    def body() -> str:
        before = transfer_metrics(prefill) if prefill is not None else None
        mismatches = []
        for ids, want in zip(prompts(), reference):
            got = run(ids)
            if got != want:
                at = harness.first_difference(got, want)
                mismatches.append(f"len {len(ids)}: first difference at {at}: {got} != {want}")
        if mismatches:
            raise AssertionError("; ".join(mismatches))
        detail = f"{len(reference)} prompts of lengths {list(PROMPT_LENGTHS)}: tokens equal"
        if prefill is not None and before is not None:
            after = transfer_metrics(prefill)
            n = after["requests"] - before["requests"]
            if n > 0:
                latency = (after["latency_ms"] - before["latency_ms"]) / n
                detail += f"; prefill's kv_transfer_latency_ms mean {latency:.1f} over {int(n)}"
            calls = after["kvplan_calls"] - before["kvplan_calls"]
            if calls > 0:
                blocks = (after["kvplan_blocks"] - before["kvplan_blocks"]) / calls
                plan_us = (after["kvplan_plan_s"] - before["kvplan_plan_s"]) / calls * 1e6
                detail += (f"; kvplan planned {int(calls)} transfer calls, mean {blocks:.1f} "
                           f"blocks and {plan_us:.0f} us each")
            elif prefill.kvplan and planned_per_call:
                raise AssertionError(detail + "; but the prefill's /metrics counts no transfer "
                                     "call planned by kvplan")
            elif prefill.kvplan:
                detail += ("; no transfer call planned per request (the KV went through the "
                           "prepared lists kvplan built at peer registration)")
        return detail

    results.check(name, body)


def wait_for_workers(router: Server, prefill: SGLangServer, timeout_s: float = 180.0) -> None:
    """The router answers /health before it has registered its workers (it does that in the
    background); until then a request gets 503 ``server_selection_failed``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            routed_generate(router, prefill, [5], 1)
            return
        except HttpError as exc:
            if exc.status != 503 or time.monotonic() > deadline:
                raise
        time.sleep(2.0)


def installed_line(server: SGLangServer) -> bool:
    return f"kvplan installed into sglang.srt.disaggregation.{server.backend}.conn" in \
        server.log_path.read_text(errors="replace")


SGLANG_REFERENCE = "SGLang's MooncakeKVManager, page size 1 (the reference)"


def run_group(results: Results, engine: Engine, label: str,
              body: Callable[[Engine, Results], None], *, reference: bool = False) -> None:
    """One group of cases on its own servers: ``body(engine, part)`` makes the servers from
    ``engine``, records its cases into ``part`` and stops the servers. A failed group whose
    logs show SGLang's transfer-thread race (``sglang_race``) runs once more on new servers
    (names ending in ``-retry``, new ports), and that run counts; so does a ``reference``
    group (SGLang's own manager: its cases are the environment's) after any failure."""
    mark = len(engine.made)
    race.run_group(results, label,
                   lambda part, retry: body(engine.retrying() if retry else engine, part),
                   lambda: [s.log_path for s in engine.made[mark:]],
                   environment=reference, retry_any_failure=reference)


# --------------------------------------------------------------------------------------------
# Cases


def run_cases(prepared: Prepared, only: set[str] | None) -> Results:
    results = Results()
    log_dir = Path(tempfile.mkdtemp(prefix="kvplan-e2e-sglang-"))
    log(f"server logs in {log_dir}")
    engine = Engine(venv=Path(prepared.venv), models=prepared.models, log_dir=log_dir,
                    ports=Ports(), nixl=Path(prepared.nixl) if prepared.nixl else None)

    def wanted(key: str) -> bool:
        return only is None or key in only

    plain = engine.server("plain", MODEL_A, page_size=1)
    reference: list[list[int]] = []  # the plain server's tokens, once it has answered

    def start(servers: Sequence[Server]) -> None:
        """Start ``servers`` and wait for them; the first time, also wait for the plain server
        (started beside them) and take its tokens."""
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(READY_TIMEOUT_S)
        if not reference and plain.proc is not None:
            plain.wait_ready(READY_TIMEOUT_S)
            reference[:] = [plain_generate(plain, ids) for ids in prompts()]
            log(f"plain server's tokens: {reference}")

    def pd(prefill: SGLangServer, decode: SGLangServer) -> Callable[[list[int]], list[int]]:
        return lambda ids: output_ids(pd_generate(prefill, decode, ids)[0])

    def sglang_reference(engine: Engine, part: Results) -> None:
        prefill = engine.server("sglang-prefill-p1", MODEL_A, page_size=1, mode="prefill")
        decode = engine.server("sglang-decode-p1", MODEL_A, page_size=1, mode="decode")
        try:
            start([prefill, decode])
            compare_all(SGLANG_REFERENCE, part, reference, pd(prefill, decode), prefill)
        finally:
            for s in (prefill, decode):
                s.stop()

    def kvplan_page_1(engine: Engine, part: Results) -> None:
        """kvplan, page size 1; bad input on the same prefill; manifests at start-up."""
        prefill = engine.server("kvplan-prefill-p1", MODEL_A, page_size=1, mode="prefill",
                                kvplan=True)
        decode = engine.server("kvplan-decode-p1", MODEL_A, page_size=1, mode="decode",
                               kvplan=True)
        short = engine.server("kvplan-decode-p1-2layers", MODEL_A_2_LAYERS, page_size=1,
                              mode="decode", kvplan=True)
        stateless = engine.server("kvplan-decode-p1-manifest-with-state", MODEL_A,
                                  page_size=1, mode="decode", kvplan=True)
        if wanted("manifest"):
            # The pair serves under the model's own manifest (a false refusal would stop
            # it); a decode told the model also has a state pool must not start.
            for server, with_state in ((prefill, False), (decode, False), (stateless, True)):
                server.env["KVPLAN_MANIFEST"] = str(write_manifest(
                    log_dir / f"{server.name}.manifest.json", MODEL_A, with_state))
        group = [prefill, decode] + ([short] if wanted("bad") else [])
        try:
            if wanted("manifest"):
                stateless.start()
            start(group)
            part.check("kvplan installed in both schedulers (KVPLAN_SGLANG_INSTALL=1)",
                       lambda: installed_check(prefill, decode))
            compare_all("kvplan in both schedulers, page size 1", part, reference,
                        pd(prefill, decode), prefill)
            if wanted("bad"):
                part.check("bad input: decode with 2 layers, prefill with 4",
                           lambda: mismatched_decode(prefill, short, decode, reference))
            if wanted("manifest"):
                part.check("manifest: the pair holds the model's manifest; a decode whose "
                           "manifest has a state pool it never registered does not start",
                           lambda: manifest_refusal(prefill, decode, stateless))
        finally:
            for s in [*group, stateless]:
                s.stop()

    def kvplan_page_16(engine: Engine, part: Results) -> None:
        """kvplan, page size 16, behind SGLang's router; the negative control; identity."""
        prefill = engine.server("kvplan-prefill-p16", MODEL_A, page_size=16, mode="prefill",
                                kvplan=True)
        other = engine.server("kvplan-prefill-p16-other-weights", MODEL_B, page_size=16,
                              mode="prefill", kvplan=True)
        renamed = engine.server("kvplan-prefill-p16-renamed", MODEL_A, page_size=16,
                                mode="prefill", kvplan=True, served_name=RENAMED)
        decode = engine.server("kvplan-decode-p16", MODEL_A, page_size=16, mode="decode",
                               kvplan=True)
        group = [prefill, decode] + ([other] if wanted("negative") else []) + (
            [renamed] if wanted("identity") else [])
        try:
            start(group)
            compare_all("kvplan in both schedulers, page size 16", part, reference,
                        pd(prefill, decode), prefill)
            if wanted("negative"):
                part.check("negative control: prefill on other weights, tokens 2.. differ",
                           lambda: negative_control(other, decode, plain))
            if wanted("identity"):
                part.check(f"identity: a prefill serving {RENAMED!r}, the decode "
                           f"{SERVED_NAMES[MODEL_A.ARCH]!r}, same weights and shapes",
                           lambda: identity_refused(renamed, decode, prefill, reference))
            if wanted("router"):
                for mini_lb, label in ((False, "SGLang's router (Rust)"),
                                       (True, "SGLang's mini load balancer")):
                    router = engine.router("mini-lb" if mini_lb else "router", prefill,
                                           decode, mini_lb=mini_lb)
                    try:
                        start([router])
                        wait_for_workers(router, prefill)
                        compare_all(f"kvplan, page size 16, behind {label}", part, reference,
                                    lambda ids: routed_generate(router, prefill, ids))
                    finally:
                        router.stop()
        finally:
            for s in group:
                s.stop()

    def staged(engine: Engine, part: Results) -> None:
        """kvplan's staged rounds between two kvplan peers; a decode without staging."""
        staged_case.run_staged(engine, MODEL_A, part, reference, start, staged_case.Hooks(
            prompts=prompts, pd_generate=pd_generate, output_ids=output_ids,
            installed_check=installed_check, max_new_tokens=MAX_NEW_TOKENS))

    def pipeline(engine: Engine, part: Results) -> None:
        """Prefill PP 2 -> decode PP 1: each stage sends its own layers, paired by layer id."""
        prefill = engine.server("kvplan-prefill-pp2", MODEL_A, page_size=16, mode="prefill",
                                kvplan=True, pp_size=2)
        decode = engine.server("kvplan-decode-pp1", MODEL_A, page_size=16, mode="decode",
                               kvplan=True)
        group = [prefill, decode]
        try:
            start(group)
            compare_all("kvplan, prefill PP 2 to decode PP 1, page size 16", part, reference,
                        pd(prefill, decode), prefill)
        finally:
            for s in group:
                s.stop()

    try:
        if any(wanted(key) for key in LLAMA_CASES):
            plain.start()  # its start-up overlaps the first group's; start() waits for it
        if wanted("sglang"):
            # SGLang's own manager failing is the environment's failure, not kvplan's: it is
            # reported as such and its pair runs once more (new servers); that counts.
            run_group(results, engine, SGLANG_REFERENCE, sglang_reference, reference=True)
        if wanted("kvplan1") or wanted("bad") or wanted("manifest"):
            run_group(results, engine, "kvplan, page size 1 (kvplan1, bad, manifest)",
                      kvplan_page_1)
        if (wanted("kvplan16") or wanted("negative") or wanted("router")
                or wanted("identity")):
            run_group(results, engine,
                      "kvplan, page size 16 (kvplan16, negative, identity, router)",
                      kvplan_page_16)
        if wanted("staged"):
            run_group(results, engine, "kvplan staged (staged)", staged)
        if wanted("pp"):
            run_group(results, engine, "kvplan, prefill PP 2 (pp)", pipeline)
        # -- the same over NIXL (UCX on loopback TCP) ------------------------------------------
        if any(wanted(key) for key in NIXL_LLAMA_CASES):
            nixl_cases(engine, results, wanted, start, plain, reference)
        # -- a linear-attention hybrid (Qwen3-Next): GDN state slots and KV pages ----------
        if any(wanted(key) for key in HYBRID_CASES):
            hybrid_cases(engine, results, wanted, start)
    except Exception as exc:  # a server that never came up fails the run, loudly
        results.record("servers", False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        print(str(exc), flush=True)
    finally:
        plain.stop()
    log(f"server logs kept in {log_dir}")
    return results


def nixl_cases(engine: Engine, results: Results, wanted: Callable[[str], bool],
               start: Callable[[Sequence[Server]], None], plain: Server,
               reference: list[list[int]]) -> None:
    """The Llama cases over ``--disaggregation-transfer-backend nixl``: SGLang's own
    NixlKVManager (the reference; a failure there is the environment's and its pair runs once
    more), then kvplan in both schedulers at page sizes 1 (with the mismatched decode) and 16
    (with the prefill on other weights)."""

    def pair(engine: Engine, tag: str, page_size: int,
             kvplan: bool) -> tuple[SGLangServer, SGLangServer]:
        return (engine.server(f"{tag}-prefill-p{page_size}", MODEL_A, page_size=page_size,
                              mode="prefill", kvplan=kvplan, backend="nixl"),
                engine.server(f"{tag}-decode-p{page_size}", MODEL_A, page_size=page_size,
                              mode="decode", kvplan=kvplan, backend="nixl"))

    def pd(prefill: SGLangServer, decode: SGLangServer) -> Callable[[list[int]], list[int]]:
        return lambda ids: output_ids(pd_generate(prefill, decode, ids)[0])

    label = "SGLang's NixlKVManager, page size 1 (the reference)"

    def nixl_reference(engine: Engine, part: Results) -> None:
        prefill, decode = pair(engine, "sglang-nixl", 1, False)
        try:
            start([prefill, decode])
            compare_all(label, part, reference, pd(prefill, decode), prefill)
        finally:
            for s in (prefill, decode):
                s.stop()

    def page_1(engine: Engine, part: Results) -> None:
        prefill, decode = pair(engine, "kvplan-nixl", 1, True)
        short = engine.server("kvplan-nixl-decode-p1-2layers", MODEL_A_2_LAYERS, page_size=1,
                              mode="decode", kvplan=True, backend="nixl")
        group = [prefill, decode] + ([short] if wanted("nixl-bad") else [])
        try:
            start(group)
            part.check("NIXL: kvplan installed in both schedulers (KVPLAN_SGLANG_INSTALL=1)",
                       lambda: installed_check(prefill, decode))
            compare_all("NIXL: kvplan in both schedulers, page size 1", part, reference,
                        pd(prefill, decode), prefill, planned_per_call=False)
            if wanted("nixl-bad"):  # last on this prefill: SGLang's refusal disables it
                part.check("NIXL bad input: decode with 2 layers, prefill with 4",
                           lambda: nixl_mismatched_decode(prefill, short))
        finally:
            for s in group:
                s.stop()

    def page_16(engine: Engine, part: Results) -> None:
        prefill, decode = pair(engine, "kvplan-nixl", 16, True)
        other = engine.server("kvplan-nixl-prefill-p16-other-weights", MODEL_B, page_size=16,
                              mode="prefill", kvplan=True, backend="nixl")
        group = [prefill, decode] + ([other] if wanted("nixl-negative") else [])
        try:
            start(group)
            compare_all("NIXL: kvplan in both schedulers, page size 16", part, reference,
                        pd(prefill, decode), prefill, planned_per_call=False)
            if wanted("nixl-negative"):
                part.check("NIXL negative control: prefill on other weights, tokens 2.. "
                           "differ", lambda: negative_control(other, decode, plain))
        finally:
            for s in group:
                s.stop()

    if wanted("nixl-sglang"):
        run_group(results, engine, label, nixl_reference, reference=True)
    if wanted("nixl1") or wanted("nixl-bad"):
        run_group(results, engine, "NIXL: kvplan, page size 1 (nixl1, nixl-bad)", page_1)
    if wanted("nixl16") or wanted("nixl-negative"):
        run_group(results, engine, "NIXL: kvplan, page size 16 (nixl16, nixl-negative)",
                  page_16)


def hybrid_cases(engine: Engine, results: Results, wanted: Callable[[str], bool],
                 start: Callable[[Sequence[Server]], None]) -> None:
    """The Qwen3-Next model through a PD pair: its pool is SGLang's hybrid pool (KV pages for
    the full-attention layer, one conv and one recurrent state slot per request for each GDN
    layer), so a transfer moves KV pages and state; the decode's first step already reads the
    transferred state. SGLang's manager first (the reference on this model), then kvplan. The
    plain server starts with the first pair (each start costs about a minute here)."""
    plain = engine.server("plain-qwen3-next", MODEL_HYBRID, page_size=1)
    reference: list[list[int]] = []

    def hybrid_pair(kvplan: bool, backend: str, label: str) -> Callable[[Engine, Results], None]:
        def body(engine: Engine, part: Results) -> None:
            tag = ("kvplan" if kvplan else "sglang") + ("-nixl" if backend == "nixl" else "")
            prefill = engine.server(f"{tag}-prefill-qwen3-next", MODEL_HYBRID, page_size=1,
                                    mode="prefill", kvplan=kvplan, backend=backend)
            decode = engine.server(f"{tag}-decode-qwen3-next", MODEL_HYBRID, page_size=1,
                                   mode="decode", kvplan=kvplan, backend=backend)
            group = [prefill, decode]
            try:
                start(group if reference else [plain, *group])
                if not reference:
                    reference[:] = [plain_generate(plain, ids) for ids in prompts()]
                    log(f"plain Qwen3-Next server's tokens: {reference}")
                if kvplan:
                    part.check("kvplan installed in both Qwen3-Next schedulers",
                               lambda: installed_check(prefill, decode))
                compare_all(label, part, reference,
                            lambda ids: output_ids(pd_generate(prefill, decode, ids)[0]),
                            prefill)
            finally:
                for s in group:
                    s.stop()
        return body

    try:
        for key, kvplan, backend, label in (
                ("hybrid-sglang", False, "mooncake",
                 "SGLang's MooncakeKVManager, Qwen3-Next hybrid (GDN state + KV), page size 1"),
                ("hybrid", True, "mooncake",
                 "kvplan in both schedulers, Qwen3-Next hybrid (GDN state + KV), page size 1"),
                ("nixl-hybrid-sglang", False, "nixl",
                 "SGLang's NixlKVManager, Qwen3-Next hybrid (GDN state + KV), page size 1"),
                ("nixl-hybrid", True, "nixl",
                 "NIXL: kvplan in both schedulers, Qwen3-Next hybrid (GDN state + KV), "
                 "page size 1")):
            if wanted(key):
                run_group(results, engine, f"{label} ({key})",
                          hybrid_pair(kvplan, backend, label))
    finally:
        plain.stop()


def installed_check(*servers: SGLangServer) -> str:
    missing = [s.name for s in servers if not installed_line(s)]
    if missing:
        raise AssertionError(f"no 'kvplan installed into' line in the logs of {missing}")
    manager = {"mooncake": "MooncakeKVManager", "nixl": "NixlKVManager"}[servers[0].backend]
    return f"each scheduler logged the install into {manager}"


def failed_request(prefill: SGLangServer, decode: SGLangServer, ids: Sequence[int],
                   used: str) -> str:
    """One PD request that must give no tokens (an HTTP error, or SGLang's abort): how it
    ended; ``used`` says in the failure what tokens would mean."""
    try:
        response, _ = pd_generate(prefill, decode, ids)
    except HttpError as exc:
        return f"decode answered HTTP {exc.status}"
    finish = response.get("meta_info", {}).get("finish_reason")
    if not (isinstance(finish, dict) and finish.get("type") == "abort"):
        raise AssertionError(f"{used}: {response}")
    return f"decode aborted the request: {finish.get('message', '')[:120]}"


def write_manifest(path: Path, model: TinyModel, with_state: bool) -> Path:
    """The tiny Llama's manifest in kvplan's JSON form, written from its shapes as a user
    writes one from a model's config (float32: 4 bytes an element): K and V on every layer,
    sharded by heads. ``with_state`` adds a per-request recurrent state on every layer
    (``mamba_temporal``, the role kvplan gives an SGLang Mamba pool's recurrent entries), which
    this model's servers never register (the case of a hybrid model whose decode left its state
    pool out)."""
    row = model.kv_heads * model.head_dim * 4
    layers = list(range(model.num_layers))
    components: list[dict[str, object]] = [
        {"role": role, "kind": "page", "layers": layers, "bytes": row, "sharding": "heads",
         "kv_heads": model.kv_heads} for role in ("k", "v")]
    if with_state:
        components.append({"role": "mamba_temporal", "kind": "state", "layers": layers,
                           "bytes": 4096, "sharding": "split"})
    path.write_text(json.dumps({"model": SERVED_NAMES[model.ARCH],
                                "num_layers": model.num_layers, "components": components}))
    return path


def manifest_refusal(prefill: SGLangServer, decode: SGLangServer,
                     stateless: SGLangServer) -> str:
    """Both started servers logged that they hold the manifest; the third exited before it
    was ready, its log naming the missing component."""
    held = "holds every component of the manifest of"
    for server in (prefill, decode):
        if held not in server.log_since(0):
            raise AssertionError(f"{server.name} has no '{held}' line")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while stateless.alive() and time.monotonic() < deadline:
        try:
            if stateless.ready():
                raise AssertionError(f"{stateless.name} started although its layout has no "
                                     "state pool")
        except harness.ServerError:
            break
        time.sleep(1.0)
    if stateless.alive():
        raise AssertionError(f"{stateless.name} neither started nor exited in "
                             f"{READY_TIMEOUT_S:.0f} s")
    lines = [line for line in stateless.log_since(0).splitlines()
             if "refusing to start" in line and "mamba_temporal" in line]
    if not lines:
        raise AssertionError(f"{stateless.name} exited without a manifest refusal naming "
                             f"mamba_temporal; log tail:\n{stateless.log_tail(15)}")
    refusal = lines[0][lines[0].index("kvplan:"):] if "kvplan:" in lines[0] else lines[0]
    return (f"{prefill.name} and {decode.name} hold it; {stateless.name} exited "
            f"({stateless.proc.returncode if stateless.proc else None}): {refusal[:260]}")


def mismatched_decode(prefill: SGLangServer, short: SGLangServer, good: SGLangServer,
                      reference: list[list[int]]) -> str:
    ids = prompts()[4]
    started = time.monotonic()
    outcome = failed_request(prefill, short, ids, "the mismatched decode produced tokens")
    took = time.monotonic() - started
    text = prefill.log_path.read_text(errors="replace")
    # Refused at the decode's registration (its layout identity: "kvplan refuses transfers
    # with peer ...") or, from a decode without one, by the transfer call ("kvplan refused").
    marker = re.compile(r"kvplan refuse(?:d|s transfers)")
    refused = [line for line in text.splitlines() if marker.search(line)]
    if not refused:
        raise AssertionError("the prefill's log has no 'kvplan refused' line")
    # The prefill's transfer thread is still alive: the good decode still gets its tokens.
    marks = {s.name: s.log_size() for s in (prefill, good)}
    try:
        again = output_ids(pd_generate(prefill, good, ids)[0])
    except HttpError as exc:
        # The logs first: the case's report line keeps the first 300 characters.
        raise AssertionError(f"after the refused request the good decode failed: "
                             f"{transfer_lines(marks, prefill, good)}; {exc}") from exc
    if again != reference[4]:
        raise AssertionError(f"after the refused request the good decode got {again}")
    first = marker.search(refused[0])
    assert first is not None
    reason = refused[0][first.start():]
    return f"{outcome} in {took:.1f} s; prefill log: {reason[:180]}; " \
        "the same prefill then serves the good decode"


def identity_refused(renamed: SGLangServer, decode: SGLangServer, good: SGLangServer,
                     reference: list[list[int]]) -> str:
    """The decode publishes its layout identity when it registers with a prefill; a prefill
    serving the model under another name refuses it before any byte moves, although weights
    and shapes are the same (without the check, its KV would give the reference's tokens):
    the request gives no tokens, the prefill's log names both names, and the decode then serves
    its own prefill's request correctly."""
    ids = prompts()[4]
    outcome = failed_request(renamed, decode, ids, "the renamed prefill's KV was used")
    text = renamed.log_path.read_text(errors="replace")
    refusals = [line for line in text.splitlines() if "kvplan refuses transfers" in line]
    if not refusals:
        raise AssertionError(f"no 'kvplan refuses transfers' line in {renamed.name}'s log")
    reason = refusals[0].split("kvplan refuses transfers", 1)[1]
    served = SERVED_NAMES[MODEL_A.ARCH]
    if RENAMED not in reason or served not in reason:
        raise AssertionError(f"the refusal does not name both models: {reason[:300]}")
    again = output_ids(pd_generate(good, decode, ids)[0])
    if again != reference[4]:
        raise AssertionError(f"after the refusal the decode's own prefill gave {again}")
    return (f"{outcome}; prefill log: kvplan refuses transfers{reason[:200]}; the decode then "
            "serves its own prefill correctly")


NIXL_FEWER_REGIONS = "NIXL PD transfer: decode registered fewer KV regions (4) than prefill (8)"


def nixl_mismatched_decode(prefill: SGLangServer, short: SGLangServer,
                           wait_s: float = 60.0) -> str:
    """SGLang's NixlKVManager checks a decode's KV region count when the decode registers
    (``_prepare_payload_xfer``), before any transfer method, kvplan's included, is called: a
    decode with fewer regions raises ``ValueError`` in the prefill's bootstrap thread, which
    ends that thread ("requests to this rank will time out in KVPoll.Bootstrapping"). The
    request must give no tokens and the prefill's log must have SGLang's reason; the prefill
    takes no further PD request after it."""
    ids = prompts()[4]
    body = generate_body(ids, MAX_NEW_TOKENS)
    body.update(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port,
                bootstrap_room=_rooms.randrange(1, 2**62))
    pool = concurrent.futures.ThreadPoolExecutor(2)
    # Neither request ends by itself (the decode waits out SGLang's bootstrap timeout): both
    # are left to end when their servers stop.
    futures = [pool.submit(harness.http_json, s.url + "/generate", body, wait_s)
               for s in (prefill, short)]
    pool.shutdown(wait=False)
    started = time.monotonic()
    while NIXL_FEWER_REGIONS not in prefill.log_path.read_text(errors="replace"):
        if time.monotonic() - started > wait_s:
            raise AssertionError(f"no {NIXL_FEWER_REGIONS!r} in the prefill's log after "
                                 f"{wait_s:.0f} s")
        time.sleep(1.0)
    took = time.monotonic() - started
    decode_answer = futures[1]
    if decode_answer.done() and decode_answer.exception() is None:
        response = decode_answer.result()
        finish = response.get("meta_info", {}).get("finish_reason")
        if not (isinstance(finish, dict) and finish.get("type") == "abort"):
            raise AssertionError(f"the mismatched decode produced tokens: {response}")
    text = prefill.log_path.read_text(errors="replace")
    if "kvplan refused" in text:
        raise AssertionError("kvplan refused a call: SGLang's check should come first")
    return (f"the prefill logged SGLang's ValueError after {took:.1f} s: "
            f"{NIXL_FEWER_REGIONS}; no tokens; no kvplan method was reached")


_TRANSFER_WORDS = ("kvplan", "fail", "Fail", "Session", "session", "timeout", "Timeout",
                   "Error", "dead")


def transfer_lines(marks: dict[str, int], *servers: Server, limit: int = 12) -> str:
    """What each server logged about transfers since ``marks`` (log sizes taken before the
    request): the server logs stay on the machine that ran the case, this goes into the
    report."""
    parts = []
    for s in servers:
        lines = [line.strip()[:300] for line in s.log_since(marks[s.name]).splitlines()
                 if any(word in line for word in _TRANSFER_WORDS)]
        parts.append(f"{s.name} logged: " + (" | ".join(lines[:limit]) or "nothing about it"))
    return "; ".join(parts)


def negative_control(other: SGLangServer, decode: SGLangServer, plain: Server) -> str:
    differ = 0
    details = []
    for ids in prompts():
        got = output_ids(pd_generate(other, decode, ids)[0])
        # The prefill samples the first token itself (from the other weights); what the decode
        # generates from the transferred KV starts at the second token.
        local = plain_generate(plain, ids + got[:1], MAX_NEW_TOKENS - 1)
        if got[1:] != local:
            differ += 1
        else:
            details.append(f"len {len(ids)} equal")
    if differ != len(PROMPT_LENGTHS):
        raise AssertionError(f"only {differ}/{len(PROMPT_LENGTHS)} prompts differ: {details}")
    return f"{differ}/{len(PROMPT_LENGTHS)} prompts differ from the decode weights' own continuation"


# --------------------------------------------------------------------------------------------


NIXL_LLAMA_CASES = ("nixl-sglang", "nixl1", "nixl-bad", "nixl16", "nixl-negative")
NIXL_HYBRID_CASES = ("nixl-hybrid-sglang", "nixl-hybrid")
LLAMA_CASES = ("sglang", "kvplan1", "bad", "manifest", "kvplan16", "negative", "identity", "router",
               "staged", "pp",
               *NIXL_LLAMA_CASES)
HYBRID_CASES = ("hybrid-sglang", "hybrid", *NIXL_HYBRID_CASES)
CASE_KEYS = (*LLAMA_CASES, *HYBRID_CASES)
#: ``--cases nixl`` names every NIXL case.
CASE_GROUPS = {"nixl": (*NIXL_LLAMA_CASES, *NIXL_HYBRID_CASES)}
#: Run unless --cases names others. "pp" is left out: SGLang 0.5.23 cannot start a prefill with
#: two pipeline stages on a CPU (its PP group builds a NCCL communicator on the CPU device and
#: raises "Expected a cuda device, but got: cpu"); `--cases pp` tries it. "hybrid-sglang" (SGLang's
#: own manager on the Qwen3-Next model) is left out for time: one more pair start, about 1.5
#: minutes here; the Llama reference proves the harness, and `--cases hybrid-sglang` runs it.
#: The NIXL cases are left out until they have passed twice in a row on this machine within the
#: time CI has for them; `--cases nixl` runs them.
DEFAULT_CASES = tuple(key for key in CASE_KEYS
                      if key not in ("pp", "hybrid-sglang", "staged", *CASE_GROUPS["nixl"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--setup-only", action="store_true", help="set up and exit")
    parser.add_argument("--cases", help=f"comma-separated subset of {','.join(CASE_KEYS)} "
                        f"(or a group: {', '.join(CASE_GROUPS)})")
    parser.add_argument("--prepared", help=argparse.SUPPRESS)  # the run inside the namespace
    args = parser.parse_args()
    only = ({key for name in args.cases.split(",") for key in CASE_GROUPS.get(name, (name,))}
            if args.cases else set(DEFAULT_CASES))
    if not only <= set(CASE_KEYS):
        parser.error(f"unknown cases {sorted(only - set(CASE_KEYS))}")

    if args.prepared:
        return harness.serve_prepared(
            "e2e-sglang", args.prepared,
            lambda state: run_cases(Prepared.from_json(state), only))
    case_args = ["--cases", args.cases] if args.cases else []
    return harness.drive("e2e-sglang", __file__, prepare=lambda: prepare().to_json(),
                         setup_only=args.setup_only, case_args=case_args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
