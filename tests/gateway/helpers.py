"""A tiny checkpoint with a tool-capable template, and a gateway served on a thread of its own."""

from __future__ import annotations

import asyncio
import pathlib
import threading

import numpy as np

from tests.text.checkpoints import qwen_style_folder


def tiny_checkpoint(folder: pathlib.Path) -> pathlib.Path:
    """A 2-layer random Llama with a Qwen2.5-style tokenizer and tool template (offline, ~2 s)."""
    import torch
    import transformers

    qwen_style_folder(folder)
    vocab = transformers.AutoTokenizer.from_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, max_position_embeddings=2048,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def config_for(folder: pathlib.Path, **sections):
    from headrace.config import load

    data = {"env": {"name": "reasoning_gym",
                    "kwargs": {"dataset": "chain_sum", "instruction": "direct", "eval_size": 8}},
            "model": {"init_from": f"hf:{folder}"},
            "sampling": {"max_new_tokens": 8, "temperature": 1.0},
            "shapes": {"buckets": [128, 1024]},
            "actor": {"max_batch": 8, "envs_per_actor": 8, "group_size": 2}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return load(data=data)


class ScriptedEngine:
    """A policy that answers with scripted texts (a fake for the sampler, so tool calls and a
    fixed conversation can be tested); its tokens are the tokenizer's, log-probs -1 each."""

    max_new_tokens = 64

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.calls: list[list[int]] = []

    def max_context(self) -> int:
        return 4096

    def open(self):
        return self

    def close(self) -> None:
        pass

    async def generate(self, context, n=1):
        self.calls.append(list(context))
        text = self.replies.pop(0) if self.replies else "done"
        ids = self.tokenizer.encode_markup(text).tolist() + [self.tokenizer.end_of_turn_id]
        ids = np.asarray(ids, np.int32)
        return [(ids, np.full(len(ids), -1.0, np.float32), 3)] * n


class Served:
    """A gateway on its own event loop thread (the real uvicorn server), for sync clients."""

    def __init__(self, make_gateway, host="127.0.0.1", token=""):
        from headrace.gateway.app import Server

        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._make, self._server_cls, self._host, self._token = make_gateway, Server, host, token
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise TimeoutError("the gateway did not start")
        if self.error is not None:
            raise self.error

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.error = None
        try:
            self.loop.run_until_complete(self._start())
        except Exception as error:  # reported by __init__
            self.error = error
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    async def _start(self):
        self.gateway, self._extra = await self._make()
        self.server = self._server_cls(self.gateway, self._host, 0, self._token)
        self.url = await self.server.start()

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn, timeout=30):
        async def wrap():
            return fn()
        return self.call(wrap(), timeout)

    def stop(self):
        async def shutdown():
            await self.server.stop()
            for task in self._extra:
                task.cancel()
            await asyncio.gather(*self._extra, return_exceptions=True)
        self.call(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
