"""Agents for the runner tests (env.kwargs.agent names them)."""

import asyncio

from openai import AsyncOpenAI

RECORDS: list[dict] = []  # every response's exact tokens, as the gateway reported them


async def recording_agent(base_url, task, seed):
    """Two calls, the second sending the first reply back; keeps what each call recorded."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": task.prompt}]
    try:
        for _ in range(2):
            r = await client.chat.completions.create(model="headrace", messages=messages,
                                                     extra_body={"return_token_ids": True})
            RECORDS.append(r.model_extra["headrace"])
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Are you sure?"}]
    finally:
        await client.close()
    return task.score(r.choices[0].message.content or "")


async def failing_agent(base_url, task, seed):
    if seed % 2:
        raise RuntimeError("agent bug")
    return await recording_agent(base_url, task, seed)


async def silent_agent(base_url, task, seed):
    """Never calls: its session times out."""
    await asyncio.sleep(3600)


async def streaming_digits_agent(base_url, task, seed):
    """A toy reward a tiny random model can learn within minutes, streamed: the share of digits
    in its one reply (docs/gateway.md, "Measured": reward rising through the gateway)."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    try:
        stream = await client.chat.completions.create(
            model="headrace", messages=[{"role": "user", "content": task.prompt}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    finally:
        await client.close()
    text = text.strip()
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)
