"""A vLLM OpenAI server as a child process: started on loopback, waited for, stopped (no JAX).

The server runs in vLLM's own environment (`actor.vllm.python`, by default the repo's
`.venv-vllm/bin/python`, made by `scripts/vllm.sh setup`) as `python -m
vllm.entrypoints.openai.api_server`, with the flags the actor's contract needs:
`--logprobs-mode processed_logprobs` (the log-probs of the distribution tokens are drawn from,
after temperature; vLLM's default is the raw logits'), `--skip-tokenizer-init` (token ids in,
token ids out: nothing is decoded and re-encoded), `--enforce-eager`, the headrace worker
extension, and `VLLM_SERVER_DEV_MODE=1` for the `/pause`, `/resume` and `/collective_rpc`
endpoints weight updates use. Its output goes to a log file, whose tail every error quotes.

Failure modes: no such interpreter, or one without vLLM, raises `EngineError` naming the set-up
command; a server that exits, or is not ready within `start_timeout_s`, raises `EngineError` with
its log's tail (and is killed). `stop` ends the whole process group (vLLM's engine core is a
child of the API server): SIGTERM, then SIGKILL after `STOP_GRACE_S`.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

from headrace.engines.base import EngineError

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
WORKER_EXTENSION = "headrace.engines.vllm_worker.HeadraceWorker"
SERVED_NAME = "headrace"
STOP_GRACE_S = 10.0
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
SETUP_HINT = "run scripts/vllm.sh setup (it builds .venv-vllm), or set actor.vllm.python"


def free_port() -> int:
    """A loopback port free now (the server binds it a moment later; a clash fails its start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def log_tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class VLLMServer:
    """One vLLM server serving the Hugging Face folder `model_dir`.

    Args:
      python: the interpreter of vLLM's environment ("" : DEFAULT_PYTHON).
      model_dir: the folder served (its weights are replaced later through the worker extension).
      dtype, max_model_len, kv_cache_gib, threads: the server's `--dtype`, `--max-model-len`,
        `VLLM_CPU_KVCACHE_SPACE` and OMP threads (bound to the first `threads` cores).
      log_path: where the server's stdout and stderr go.
      lora_rank: > 0 serves LoRA adapters of up to this rank, loaded at run time
        (`/v1/load_lora_adapter`) and chosen per request by name; 0: none.
    """

    def __init__(self, model_dir: str | os.PathLike, log_path: str | os.PathLike, *,
                 python: str = "", dtype: str = "float32", max_model_len: int = 2048,
                 kv_cache_gib: float = 1.0, threads: int = 1, start_timeout_s: float = 300.0,
                 lora_rank: int = 0):
        self.python = pathlib.Path(python) if python else DEFAULT_PYTHON
        self.model_dir = pathlib.Path(model_dir)
        self.log_path = pathlib.Path(log_path)
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_cache_gib, self.threads = kv_cache_gib, threads
        self.start_timeout_s = start_timeout_s
        self.lora_rank = lora_rank
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.ready_s = float("nan")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return self._base_command() + self._lora_flags()

    def _lora_flags(self) -> list[str]:
        if not self.lora_rank:
            return []
        # vLLM sizes its adapter buffers by --max-lora-rank, which must be one of these
        if self.lora_rank > LORA_RANKS[-1]:
            raise ValueError(f"LoRA rank {self.lora_rank}: vLLM serves ranks up to "
                             f"{LORA_RANKS[-1]}")
        rank = next(r for r in LORA_RANKS if r >= self.lora_rank)
        # two adapters in a batch: requests sent before an update finish with the old version
        # while new ones start with the new; a few more kept in memory
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2",
                "--max-cpu-loras", "4"]

    def _base_command(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--enforce-eager",
                "--logprobs-mode", "processed_logprobs", "--skip-tokenizer-init",
                "--worker-extension-cls", WORKER_EXTENSION, "--disable-log-stats",
                # a cached prefix would let a request after an update start from keys and
                # values of an older version while stamped with the new one
                "--no-enable-prefix-caching",
                "--uvicorn-log-level", "warning"]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        cores = "0" if self.threads == 1 else f"0-{self.threads - 1}"
        env.update(VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gib:g}",
                   VLLM_CPU_OMP_THREADS_BIND=cores, OMP_NUM_THREADS=str(self.threads),
                   VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                   VLLM_ALLOW_RUNTIME_LORA_UPDATING="1" if self.lora_rank else "0",
                   VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   # the worker extension imports headrace from this tree
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            env.get("PYTHONPATH", "")])))
        for key in ("JAX_PLATFORMS", "XLA_FLAGS"):  # the actor's, meaningless there
            env.pop(key, None)
        return env

    def start(self) -> VLLMServer:
        """Starts the server and waits until it answers /health.

        Raises:
          EngineError: no vLLM environment, or the server exited or was not ready in time.
        """
        if not self.python.is_file():
            raise EngineError(f"actor.engine=vllm: no interpreter at {self.python}; {SETUP_HINT}")
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.environment(),
                                            start_new_session=True)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started
        return self

    def _wait_ready(self, started: float) -> None:
        with httpx.Client(timeout=5.0) as client:
            while True:
                process = self.process
                if process is None:
                    raise EngineError("the vLLM server was stopped while starting")
                code = process.poll()
                if code is not None:
                    raise EngineError(f"the vLLM server exited with status {code} while "
                                      f"starting; {self.log_path} ends with:\n"
                                      f"{log_tail(self.log_path)}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() - started > self.start_timeout_s:
                    raise EngineError(f"the vLLM server was not ready in {self.start_timeout_s:.0f}"
                                      f" s (actor.vllm.start_timeout_s); {self.log_path} ends "
                                      f"with:\n{log_tail(self.log_path)}")
                time.sleep(0.5)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def describe_death(self) -> str:
        """Why the server is unusable, for an error message ("" when it still runs)."""
        if self.alive():
            return ""
        code = None if self.process is None else self.process.returncode
        return (f"the vLLM server exited (status {code}); {self.log_path} ends with:\n"
                f"{log_tail(self.log_path)}")

    def stop(self) -> None:
        """Ends the server's process group; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(STOP_GRACE_S)
            except ProcessLookupError:
                pass
        else:  # the server is gone; children it left (vLLM's engine core) still go
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":  # `python -m headrace.engines.vllm_server DIR`: serve a folder by hand
    server = VLLMServer(sys.argv[1], pathlib.Path(sys.argv[1]) / "vllm.log").start()
    print(f"{server.url} ready in {server.ready_s:.1f} s; Ctrl-C stops it", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        server.stop()
