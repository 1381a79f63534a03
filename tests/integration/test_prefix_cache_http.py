"""A shared system prompt is served from the prefix cache: visible in the OpenAI
``usage.prompt_tokens_details.cached_tokens`` and in ``/metrics`` (spec §7.7)."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = ("You are the support assistant of the Example Railway Company. Be polite, answer "
          "in one sentence, mention the relevant timetable, and never promise refunds. ") * 3


def gauges(text):
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_shared_system_prompt_reports_cached_tokens(live, client):
    api = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x")
    model = live.engine.model_name

    async def ask(q):
        return await api.chat.completions.create(
            model=model, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])

    before = gauges((await client.get("/metrics")).text)
    first = await ask("When does the first train leave on Sunday?")
    second = await ask("Can I bring a bicycle on board?")
    block = live.engine.cfg.block_size
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2 - block
    assert second.usage.prompt_tokens_details.cached_tokens % block == 0
    after = gauges((await client.get("/metrics")).text)
    assert after["npu_radix_match_hit_num"] - before["npu_radix_match_hit_num"] >= \
        second.usage.prompt_tokens_details.cached_tokens
    assert 0 < after["npu_prefix_cache_hit_rate"] <= 1
    await live.assert_idle_and_leak_free()
