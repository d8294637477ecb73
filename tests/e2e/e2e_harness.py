"""Shared harness for running real serving engines end to end on this machine.

Engine-neutral pieces, used by ``vllm_e2e.py`` and meant for any other engine's driver:

* a cache directory outside the clone (``~/.cache/kvplan/e2e``, or ``$KVPLAN_E2E_CACHE``) with
  venvs that are built once from a recorded recipe and reused while the recipe is unchanged;
* kvplan installed into such a venv from the checkout under test on every run (a wheel built
  with maturin), never from the cache;
* tiny random-weight Llama models and a byte-level BPE tokenizer built offline;
* servers as process groups with a ready-wait on an HTTP path, logs captured to files and their
  tail shown on failure, stopped with SIGTERM then SIGKILL;
* a private network namespace (root only: ``unshare -n`` and ``ip link set lo up``) so nothing a
  server binds is reachable beyond loopback, and the machine-wide server lock;
* JSON over HTTP, greedy token comparison, one line per case and the closing
  ``N passed, M failed`` line.

This file runs under any Python 3.10+ with the standard library only: the driver builds the
venv it then runs servers from.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): .+")
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_LOCK = Path("/tmp/kvplan-servers.lock")
NETNS_ENV = "KVPLAN_E2E_IN_NETNS"
LOCK_HELD_ENV = "KVPLAN_E2E_SERVER_LOCK_HELD"


class SetupError(RuntimeError):
    """Set-up could not complete: the run must fail, never skip."""


class ServerError(RuntimeError):
    """A server died or never became ready; the message carries its log tail, ``root_cause``
    the first exception its log names."""

    def __init__(self, message: str, root_cause: str = "") -> None:
        super().__init__(message)
        self.root_cause = root_cause


def log(message: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Cache and venvs


def cache_root() -> Path:
    root = Path(os.environ.get("KVPLAN_E2E_CACHE", Path.home() / ".cache" / "kvplan" / "e2e"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def run(cmd: Sequence[str | os.PathLike[str]], *, cwd: Path | None = None,
        env: dict[str, str] | None = None, quiet: bool = False) -> str:
    """Run a set-up command; any failure is a SetupError with the command's output."""
    argv = [str(a) for a in cmd]
    if not quiet:
        log("$ " + " ".join(argv))
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        raise SetupError(f"command failed ({proc.returncode}): {' '.join(argv)}\n"
                         + proc.stdout[-6000:])
    return proc.stdout


@dataclass
class Venv:
    """A cached venv: ``steps`` are pip argument lists, run in order on a fresh venv.

    The recipe (python version and steps) is hashed into a marker written last; a venv whose
    marker is missing or different is removed and built again, so an interrupted set-up never
    passes for a finished one.
    """

    path: Path
    steps: list[list[str]]
    python: str = sys.executable

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def py(self) -> Path:
        return self.bin / "python"

    def recipe_digest(self) -> str:
        recipe = {"python": sys.version_info[:2], "steps": self.steps}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def marker(self) -> Path:
        return self.path / ".kvplan-e2e-ready"

    def ready(self) -> bool:
        return self.py.exists() and self.marker.exists() and \
            self.marker.read_text().strip() == self.recipe_digest()

    def ensure(self) -> Venv:
        if self.ready():
            log(f"reusing venv {self.path}")
            return self
        if self.path.exists():
            log(f"removing incomplete or outdated venv {self.path}")
            shutil.rmtree(self.path)
        started = time.monotonic()
        run([self.python, "-m", "venv", self.path])
        run([self.py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-U", "pip"])
        for step in self.steps:
            run([self.py, "-m", "pip", "install", "--disable-pip-version-check",
                 "--progress-bar", "off", *step])
        self.marker.write_text(self.recipe_digest() + "\n")
        log(f"venv {self.path} set up in {time.monotonic() - started:.0f} s")
        return self


def download_wheel(requirement: str, dest: Path, python: str = sys.executable) -> Path:
    """One wheel, without dependencies, cached in ``dest`` (a file pip leaves half-written is
    never found: it downloads into a temporary folder first)."""
    dest.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_").lower() + "-" + version + "-"
    for found in dest.glob("*.whl"):
        if found.name.lower().startswith(stem):
            return found
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        run([python, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
             "--only-binary", ":all:", "-d", tmp, requirement])
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SetupError(f"pip download {requirement} gave {wheels}")
        target = dest / wheels[0].name
        wheels[0].rename(target)
        return target


def wheel_requirements(wheel: Path, *, drop: Callable[[str], bool],
                       replace: dict[str, str]) -> list[str]:
    """The wheel's ``Requires-Dist`` entries (no extras) whose markers hold on this machine,
    with ``replace`` applied by project name and ``drop``-ped names left out."""
    import zipfile

    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors packaging
        from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    with zipfile.ZipFile(wheel) as zf:
        metadata_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(metadata_name).decode().splitlines()
    env = default_environment()
    env["extra"] = ""
    out: list[str] = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = req.name.lower().replace("_", "-")
        if drop(key):
            continue
        text = replace.get(key)
        if text is None:
            text = req.name + ("[" + ",".join(sorted(req.extras)) + "]" if req.extras else "") \
                + str(req.specifier)
        if text not in out:
            out.append(text)
    return out


BUILD_LOCK = Path("/tmp/kvplan-build.lock")


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """The lock scripts/dev-build takes (``flock(1)`` on the same file) around a build in the
    checkout's target folder."""
    with open(BUILD_LOCK, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def install_checkout(venv: Venv, checkout: Path = REPO_ROOT) -> str:
    """Build kvplan's wheel from ``checkout`` and install it into ``venv`` (no dependencies:
    numpy is already there). Returns the installed kvplan's path."""
    maturin = checkout / ".venv" / "bin" / "maturin"
    with tempfile.TemporaryDirectory(prefix="kvplan-e2e-wheel-") as out:
        if maturin.exists():
            # scripts/dev-build's lock: a build beside it in the same target folder can remove
            # the library maturin is packing ("failed to open .../libkvplan_py.so").
            with build_lock():
                run([maturin, "build", "--release", "--quiet", "--out", out], cwd=checkout)
        else:
            run([venv.py, "-m", "pip", "wheel", "--no-deps", "-w", out, checkout])
        wheels = list(Path(out).glob("kvplan-*.whl"))
        if len(wheels) != 1:
            raise SetupError(f"building kvplan's wheel gave {wheels}")
        run([venv.py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
             "--force-reinstall", wheels[0]])
    where = run([venv.py, "-c", "import kvplan, kvplan._core; print(kvplan.__file__)"],
                quiet=True).strip()
    if not where.startswith(str(venv.path)):
        raise SetupError(f"kvplan imports from {where}, not from the venv {venv.path}")
    return where


# --------------------------------------------------------------------------------------------
# Tiny models


class _SpecDigest:
    """A model spec's cache key: its class and fields, so a changed spec builds anew."""

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TinyModel(_SpecDigest):
    """A random-weight Llama of a few MB; ``seed`` picks the weights, the rest the shapes."""

    #: What the builder makes (a class constant: not part of the digest, so cached models keep
    #: their folders).
    ARCH: ClassVar[str] = "llama"

    name: str
    seed: int
    num_layers: int = 4
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 1024
    init_range: float = 0.2


@dataclass(frozen=True)
class TinyQwen3Next(_SpecDigest):
    """A random-weight Qwen3-Next (``Qwen3NextForCausalLM``) of a few MB: a linear-attention
    hybrid whose layers ``i`` with ``(i + 1) % full_attention_interval == 0`` are full (gated)
    attention and the others gated delta net (causal conv1d + gated delta rule, with
    per-request conv and recurrent state), every layer's MLP a small MoE (no shared expert by
    default, see below). Same tokenizer as :class:`TinyModel`."""

    ARCH: ClassVar[str] = "qwen3_next"

    name: str
    seed: int
    num_layers: int = 4
    full_attention_interval: int = 4
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 32
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    conv_kernel: int = 4
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate: int = 64
    # 0: no shared expert. With one, SGLang's MoE block (qwen2_moe.py) gates its output with a
    # Triton kernel (fused_gate_sigmoid_mul_add) on a CPU without AMX.
    shared_expert_intermediate: int = 0
    vocab: int = 512
    max_positions: int = 1024
    init_range: float = 0.2


_MODEL_BUILDER = r'''
import json, re, sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
corpus = ["the quick brown fox jumps over the lazy dog", "prefill and decode share a cache",
          "blocks of tokens move between servers", "kvplan plans every byte of the transfer",
          "hello world 0123456789", "a long prompt repeats itself many many times"] * 20


def save_qwen3_next(spec, out):
    # Saved as Qwen3-Next checkpoints are published (one tensor per expert and projection),
    # which is what SGLang's loader maps; transformers may hold the experts fused.
    from safetensors.torch import save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"],
        num_hidden_layers=spec["num_layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
        linear_num_key_heads=spec["linear_key_heads"],
        linear_num_value_heads=spec["linear_value_heads"],
        linear_key_head_dim=spec["linear_key_head_dim"],
        linear_value_head_dim=spec["linear_value_head_dim"],
        linear_conv_kernel_dim=spec["conv_kernel"], num_experts=spec["num_experts"],
        num_experts_per_tok=spec["experts_per_token"],
        moe_intermediate_size=spec["moe_intermediate"],
        shared_expert_intermediate_size=spec["shared_expert_intermediate"],
        intermediate_size=spec["moe_intermediate"], decoder_sparse_step=1,
        full_attention_interval=spec["full_attention_interval"],
        layer_types=["full_attention" if (i + 1) % spec["full_attention_interval"] == 0
                     else "linear_attention" for i in range(spec["num_layers"])],
        max_position_embeddings=spec["max_positions"], initializer_range=spec["init_range"],
        torch_dtype="float32", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = Qwen3NextForCausalLM(cfg).to(torch.float32)
    tensors = {}
    for name, t in model.state_dict().items():
        fused = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if fused is None:
            if t.numel() > 0:  # a shared expert of size 0 has empty weights; SGLang has none
                tensors[name] = t.contiguous()
            continue
        prefix, which = fused.groups()
        # transformers 5: gate_up_proj [experts, 2 * I, H] (gate rows first), down_proj
        # [experts, H, I]; each expert's slice is the [out, in] Linear weight.
        for e in range(t.shape[0]):
            if which == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                tensors[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    config = cfg.to_dict()
    config.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                  full_attention_interval=spec["full_attention_interval"], torch_dtype="float32")
    with open(f"{out}/config.json", "w") as fh:
        json.dump(config, fh, indent=1, default=str)


for spec, out in json.loads(sys.argv[1]):
    torch.manual_seed(spec["seed"])
    if spec["arch"] == "qwen3_next":
        import os
        os.makedirs(out, exist_ok=True)
        save_qwen3_next(spec, out)
    else:
        cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                          intermediate_size=spec["intermediate"],
                          num_hidden_layers=spec["num_layers"],
                          num_attention_heads=spec["heads"],
                          num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                          max_position_embeddings=spec["max_positions"],
                          initializer_range=spec["init_range"], torch_dtype="float32",
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=spec["vocab"], special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.model_max_length = spec["max_positions"]
    fast.save_pretrained(out)
'''


def build_tiny_models(venv: Venv,
                      specs: dict[str, TinyModel] | dict[str, TinyQwen3Next]
                      | dict[str, TinyModel | TinyQwen3Next]) -> dict[str, Path]:
    """Build (once each, cached by spec) tiny models and tokenizers with the venv's
    transformers, all missing ones in one process (importing torch dominates)."""
    paths = {key: cache_root() / "models" / f"{m.name}-{m.digest()}" for key, m in specs.items()}
    missing = [(key, m) for key, m in specs.items()
               if not (paths[key] / ".kvplan-e2e-ready").exists()]
    if missing:
        for key, _ in missing:
            if paths[key].exists():
                shutil.rmtree(paths[key])
        jobs = [({"arch": m.ARCH,
                  **{k: getattr(m, k) for k in m.__dataclass_fields__ if k != "name"}},
                 str(paths[key])) for key, m in missing]
        log(f"building tiny models {[m.name for _, m in missing]}")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        run([venv.py, "-c", _MODEL_BUILDER, json.dumps(jobs)], env=env, quiet=True)
        for key, m in missing:
            (paths[key] / ".kvplan-e2e-ready").write_text(m.digest() + "\n")
    return paths


# --------------------------------------------------------------------------------------------
# Network namespace and the server lock


def in_private_netns() -> bool:
    return os.environ.get(NETNS_ENV) == "1"


def reexec_in_private_netns(argv: Sequence[str]) -> int:
    """Run ``argv`` in a new network namespace with only loopback up (root only). Returns the
    child's exit code. Without root it runs in the host's namespace and says so."""
    env = dict(os.environ, **{NETNS_ENV: "1"})
    if os.geteuid() != 0:
        log("not root: servers run in the host's network namespace (they bind loopback where "
            "the engine lets them)")
        return subprocess.call(list(argv), env=env)
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SetupError("running as root needs `unshare` and `ip` for the private network "
                         "namespace (Debian packages util-linux and iproute2)")
    script = 'ip link set lo up && exec "$@"'
    return subprocess.call(["unshare", "-n", "--", "sh", "-c", script, "sh", *argv], env=env)


@contextlib.contextmanager
def server_lock(path: Path = SERVER_LOCK) -> Iterator[None]:
    """The machine-wide lock for running LLM servers (the same lock ``flock(1)`` takes)."""
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {path} (another set of servers is running)")
            fcntl.flock(fh, fcntl.LOCK_EX)
        log(f"holding {path}")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# Servers


@dataclass
class Server:
    """One server process group with its log file; ``ready_path`` answers 200 when it serves."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str]
    log_dir: Path
    ready_path: str = "/health"
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> Server:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.log_path, "wb")
        fh.write(("$ " + " ".join(self.argv) + "\n").encode())
        fh.flush()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        fh.close()
        log(f"started {self.name} (pid {self.proc.pid}, port {self.port}, log {self.log_path})")
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """What the server logged after ``offset`` (a :meth:`log_size` taken earlier)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def root_cause(self) -> str:
        """The first ``SomethingError: message`` line of the log (an engine's later lines
        only say that its worker or core failed)."""
        for line in self.log_since(0).splitlines():
            if " WARNING " in line or " INFO " in line:
                continue
            found = EXCEPTION_LINE.search(line)
            if found:
                return found.group(0)[:300]
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """True once ``ready_path`` answers 200; a ServerError when the process has exited."""
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise ServerError(f"{self.name} exited ({code}) before it was ready; log tail:\n"
                              + self.log_tail(), self.root_cause())
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        wait_all_ready([self], timeout_s)

    def terminate(self) -> None:
        """Ask the process group to stop (SIGTERM) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.stopped:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # Children (an engine core) may outlive the leader briefly; the group goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.stopped = True
        log(f"stopped {self.name}")


def py_spy() -> str | None:
    """A py-spy binary: on PATH, or one a cached venv installed (SGLang's requirements have it;
    it reads any CPython process)."""
    found = shutil.which("py-spy")
    if found:
        return found
    cached = sorted(cache_root().glob("venv-*/bin/py-spy"))
    return str(cached[0]) if cached else None


def dump_stacks(server: Server, why: str) -> str:
    """Every thread's Python stack in every process of ``server``'s group (``py-spy dump``),
    written next to its log as ``<name>.stacks.txt``: a request that hangs leaves the frames it
    hung in. Returns a short note for the case's line (the file, and each process's frames
    that are not a thread pool's idle wait)."""
    spy = py_spy()
    if server.proc is None or spy is None:
        return "no stacks: " + ("no py-spy here" if spy is None else "server not started")
    listing = subprocess.run(["ps", "-eo", "pid=,pgid="], stdout=subprocess.PIPE, text=True,
                             check=False).stdout.split()
    pids = [int(pid) for pid, group in zip(listing[::2], listing[1::2])
            if int(group) == server.proc.pid]
    out_path = server.log_dir / f"{server.name}.stacks.txt"
    busy: list[str] = []
    with open(out_path, "a") as out:
        out.write(f"=== {time.strftime('%H:%M:%S')} {why}\n")
        for pid in pids:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=60,
                                      check=False).stdout
            except subprocess.TimeoutExpired:
                dump = "py-spy dump timed out\n"
            out.write(f"--- pid {pid}\n{dump}\n")
            frames = [ln.strip() for ln in dump.splitlines()
                      if re.match(r"^    \S.*\(.*:\d+\)$", ln)]
            idle = ("wait (threading.py", "_worker (concurrent", "select (selectors.py",
                    "poll (", "recv_multipart", "dequeue (")
            active = [f for f in frames if not any(word in f for word in idle)]
            if active:
                busy.append(f"pid {pid}: {active[0][:120]}")
    return f"stacks in {out_path}" + (f" ({'; '.join(busy[:3])})" if busy else "")


def wait_all_ready(servers: Sequence[Server], timeout_s: float) -> None:
    """Wait until every server is ready; the first one to exit (or the timeout) raises at once,
    so a server that cannot start costs no more than its own start."""
    started = time.monotonic()
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.ready():
                log(f"{server.name} ready after {time.monotonic() - started:.0f} s")
                pending.remove(server)
        if pending and time.monotonic() - started > timeout_s:
            raise ServerError(f"{pending[0].name} not ready after {timeout_s:.0f} s; log tail:\n"
                              + pending[0].log_tail(), pending[0].root_cause())
        if pending:
            time.sleep(1.0)


@contextlib.contextmanager
def running(servers: Sequence[Server], ready_timeout_s: float) -> Iterator[Sequence[Server]]:
    """Start every server, wait for all to be ready, and stop all of them however the block
    ends."""
    try:
        for server in servers:
            server.start()
        wait_all_ready(servers, ready_timeout_s)
        yield servers
    finally:
        for server in servers:  # all at once: each takes seconds to shut down
            server.terminate()
        for server in servers:
            server.stop()


# --------------------------------------------------------------------------------------------
# HTTP


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def http_json(url: str, payload: dict[str, Any] | None = None, timeout_s: float = 120.0) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise HttpError(exc.code, exc.read().decode(errors="replace")) from None


def http_text(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode())


# --------------------------------------------------------------------------------------------
# Cases and the summary


@dataclass
class Results:
    """Case outcomes, one printed line each.

    Cases of the engine's own connector or manager (the reference that proves the harness)
    are ``environment`` cases: when one fails, the machine or the harness failed, not kvplan.
    Their failed lines read ``ENV-FAIL`` and are counted apart from kvplan's (``FAIL``); a
    driver runs such a set once more (:meth:`note_retry`) and counts the second run. ``SKIP``
    lines name a case that could not run here and why; they neither pass nor fail."""

    passed: int = 0
    failed: int = 0
    lines: list[str] = field(default_factory=list)
    environment: bool = False
    skipped: int = 0
    env_passed: int = 0
    env_failed: int = 0
    retried: list[str] = field(default_factory=list)
    suffix: str = ""

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        name += self.suffix
        if ok:
            self.passed += 1
            self.env_passed += int(self.environment)
        else:
            self.failed += 1
            self.env_failed += int(self.environment)
        word = "PASS" if ok else "ENV-FAIL" if self.environment else "FAIL"
        line = f"{word}  {name}" + (f"  ({detail})" if detail else "")
        self.lines.append(line)
        print(line, flush=True)

    def skip(self, name: str, reason: str) -> None:
        self.skipped += 1
        line = f"SKIP  {name}  ({reason})"
        self.lines.append(line)
        print(line, flush=True)

    def check(self, name: str, body: Callable[[], str | None]) -> bool:
        """Run one case: it passes when ``body`` returns (its string is the detail) and fails
        with the exception's text otherwise."""
        try:
            detail = body()
        except Exception as exc:  # a case's failure is reported, and the run goes on
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.record(name, False, f"{type(exc).__name__}: {first[:300]}")
            traceback.print_exc(file=sys.stdout)
            return False
        self.record(name, True, detail or "")
        return True

    def part(self, *, environment: bool, suffix: str = "") -> Results:
        """An empty Results for one set's cases, to :meth:`absorb` (or retry) afterwards;
        ``suffix`` is added to each of its case names (`` [retry]``)."""
        return Results(environment=environment, suffix=suffix)

    def absorb(self, part: Results) -> None:
        self.passed += part.passed
        self.failed += part.failed
        self.skipped += part.skipped
        self.env_passed += part.env_passed
        self.env_failed += part.env_failed
        self.lines += part.lines

    def note_retry(self, label: str, part: Results, cause: str = "") -> None:
        """``part`` (a set's first run) failed for the environment: say so, keep its lines out
        of the counts, and let the driver run the set again. Without ``cause`` the set is one
        of the engine's own connector; ``cause`` names what else failed (the log and line that
        show it)."""
        counts = f"{part.failed} of {part.passed + part.failed}"
        what = f"cases failed after {cause}" if cause else \
            "cases of the engine's own connector failed"
        note = (f"{label}: {counts} {what}: an environment failure, not kvplan's; the set runs "
                f"once more and that run counts")
        self.retried.append(f"{label} ({counts} failed on the first run"
                            + (f"; {cause})" if cause else ")"))
        line = f"RETRY {note}"
        self.lines.append(line)
        print(line, flush=True)

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed" + (
            f", {self.skipped} skipped" if self.skipped else "")

    def summary_lines(self, tag: str) -> list[str]:
        """The closing lines: the totals, then kvplan's cases and the environment's apart."""
        kv_passed, kv_failed = self.passed - self.env_passed, self.failed - self.env_failed
        lines = [f"{tag}: {self.summary()}",
                 f"{tag} kvplan cases: {kv_passed} passed, {kv_failed} failed",
                 f"{tag} reference (environment) cases: {self.env_passed} passed, "
                 f"{self.env_failed} failed; sets run again after an environment failure: "
                 + ("; ".join(self.retried) if self.retried else "none")]
        return lines


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------------------------
# A driver's two halves


def drive(tag: str, script: str, *, prepare: Callable[[], str], setup_only: bool,
          case_args: Sequence[str]) -> int:
    """The outer half of a driver: set up (``prepare`` returns the prepared state as text; a
    SetupError fails the run with one FAIL line), then re-run ``script --prepared STATE
    *case_args`` in a private network namespace (set-up needed the network, the servers must
    not have it). Returns the exit code.

    The whole of it holds the machine-wide server lock: set-up installs kvplan from this
    checkout into the shared cached venv, so a run from another checkout must not install its
    kvplan between this one's install and its servers' imports."""
    started = time.monotonic()
    with server_lock():
        try:
            state = prepare()
        except SetupError as exc:
            print(f"FAIL  set-up: {exc}", flush=True)
            print(f"{tag}: 0 passed, 1 failed", flush=True)
            return 1
        log(f"set-up done in {time.monotonic() - started:.0f} s")
        if setup_only:
            return 0
        with tempfile.TemporaryDirectory(prefix=f"kvplan-{tag}-") as tmp:
            state_path = Path(tmp) / "prepared.json"
            state_path.write_text(state)
            os.environ[LOCK_HELD_ENV] = "1"  # the child runs under this process's lock
            code = reexec_in_private_netns([sys.executable, str(Path(script).resolve()),
                                            "--prepared", str(state_path), *case_args])
    log(f"{tag} took {time.monotonic() - started:.0f} s")
    return code


def serve_prepared(tag: str, state_path: str, run_cases: Callable[[str], Results]) -> int:
    """The inner half, inside the namespace: run the cases from the prepared state under the
    machine-wide server lock (its parent's, when :func:`drive` started it) and print
    ``tag: N passed, M failed``."""
    held = os.environ.get(LOCK_HELD_ENV) == "1"
    with contextlib.nullcontext() if held else server_lock():
        results = run_cases(Path(state_path).read_text())
    for line in results.summary_lines(tag):
        print(line, flush=True)
    return 0 if results.failed == 0 and results.passed > 0 else 1
