"""MindIE config.json loading (spec/config.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenserve.config.mindie_json import GB, load_mindie_config

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config.json"


def write(tmp_path, doc):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(doc))
    return p


def edited(**sections):
    doc = json.loads(SAMPLE.read_text())
    for path, value in sections.items():
        *keys, last = path.split("__")
        node = doc
        for k in keys:
            node = node[k] if not k.isdigit() else node[int(k)]
        node[last] = value
    return doc


def test_sample_config_maps_onto_engine_and_server():
    cfg = load_mindie_config(SAMPLE)
    e, s = cfg.engine, cfg.server
    assert (s.host, s.port, s.management_port, s.metrics_port) == ("127.0.0.1", 1025, 1026, 1027)
    assert s.max_body_bytes == 40 << 20
    assert e.served_model_name == "SmolLM2-135M-Instruct" and e.model is None
    assert (e.max_seq_len, e.max_input_len, e.block_size) == (4096, 2048, 128)
    assert (e.max_batch_size, e.max_prefill_batch_size, e.max_num_batched_tokens) == (200, 50, 8192)
    assert e.max_iter_times == 512 and e.enable_prefix_caching
    assert e.kv_cache_bytes == 1 * GB  # cpuMemSize on a CPU server
    assert e.token_timeout_s == 600 and e.e2e_timeout_s == 600


@pytest.mark.parametrize("path,value,needle", [
    ("ServerConfig__port", 80, "ServerConfig.port"),
    ("ServerConfig__port", "1025", "ServerConfig.port"),
    ("ServerConfig__tokenTimeout", 0, "tokenTimeout"),
    ("ServerConfig__httpsEnabled", True, "httpsEnabled"),
    ("BackendConfig__ScheduleConfig__cacheBlockSize", 256, "cacheBlockSize"),
    ("BackendConfig__ScheduleConfig__maxBatchSize", 0, "maxBatchSize"),
    ("BackendConfig__ScheduleConfig__maxPrefillBatchSize", 500, "maxPrefillBatchSize"),
    ("BackendConfig__ScheduleConfig__maxIterTimes", 9999, "maxIterTimes"),
    ("BackendConfig__ScheduleConfig__enablePrefixCache", 1, "enablePrefixCache"),
    ("BackendConfig__ScheduleConfig__maxLongPartialPrefills", 65, "maxLongPartialPrefills"),
    ("BackendConfig__ModelDeployConfig__maxSeqLen", -5, "maxSeqLen"),
    ("BackendConfig__ModelDeployConfig__ModelConfig__0__modelName", "bad name!", "modelName"),
    ("BackendConfig__ModelDeployConfig__ModelConfig__0__npuMemSize", 0, "npuMemSize"),
])
def test_bad_values_are_startup_errors_naming_the_key(tmp_path, path, value, needle):
    with pytest.raises(ValueError, match=needle):
        load_mindie_config(write(tmp_path, edited(**{path: value})))


def test_partial_prefill_keys(tmp_path):
    doc = edited(BackendConfig__ScheduleConfig__longPrefillTokenThreshold=512,
                 BackendConfig__ScheduleConfig__maxLongPartialPrefills=2)
    e = load_mindie_config(write(tmp_path, doc)).engine
    assert (e.long_prefill_token_threshold, e.max_long_partial_prefills) == (512, 2)
    doc["BackendConfig"]["ScheduleConfig"]["maxNumPartialPrefills"] = 1  # long <= num
    with pytest.raises(ValueError, match="maxLongPartialPrefills"):
        load_mindie_config(write(tmp_path, doc))


def test_unknown_keys_ignored_and_not_json_rejected(tmp_path):
    doc = edited(ServerConfig__somethingNew=123)
    doc["Extra"] = {"x": 1}
    assert load_mindie_config(write(tmp_path, doc)).server.port == 1025
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_mindie_config(p)


def test_accelerator_uses_npu_mem_size(tmp_path):
    doc = edited(BackendConfig__ModelDeployConfig__ModelConfig__0__npuMemSize=3)
    assert load_mindie_config(write(tmp_path, doc), accelerator=True).engine.kv_cache_bytes == 3 * GB
