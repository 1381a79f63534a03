"""Tensor parallelism (issue 41): the split (pure), the settings, and the decoder on two and
four gloo ranks (processes) against one process."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from tests.tp_harness import run_ranks
from tests.unit.test_decoder import BLOCK, _cfg, _state_dict
from tokenserve.config.flags import add_serve_flags, serve_config
from tokenserve.config.mindie_json import load_mindie_config
from tokenserve.config.tree import ParallelConfig
from tokenserve.engine.tensor_parallel import _context, _shards, cpu_sets
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.config import ModelConfig
from tokenserve.models.decoder import CausalLM
from tokenserve.models.tensor_parallel import plan_shard, shard_config, shard_state_dict
from tokenserve.ops.collectives import ShmCollectives
from tokenserve.ops.quant import dequantize_ref, quantize_ref


def _model_cfg(heads: int, kv: int, inter: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(
        name="t", model_type="llama", vocab_size=vocab, hidden_size=576, intermediate_size=inter,
        num_layers=2, num_heads=heads, num_kv_heads=kv, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=1e4, rope_scaling=None, max_position_embeddings=128,
        tie_word_embeddings=True, attention_bias=False, sliding_window=None, bos_token_id=1,
        eos_token_ids=(2,), torch_dtype="float32")


# ---------------------------------------------------------------------------- the split


@pytest.mark.parametrize("heads,kv,world", [(9, 3, 2), (9, 3, 3), (32, 8, 2), (32, 8, 8),
                                            (4, 2, 4), (8, 1, 4), (24, 8, 4)])
def test_every_head_column_and_row_is_held_once(heads, kv, world):
    cfg = _model_cfg(heads, kv)
    shards = [plan_shard(cfg, r, world) for r in range(world)]
    q = [h for s in shards for h in range(*s.q_heads)]
    assert q == list(range(heads))  # each query head exactly once, in rank order
    group = heads // kv
    for s in shards:  # a rank's query heads read its own KV heads (ordinary GQA)
        assert s.num_heads % s.num_kv_heads == 0 and s.num_heads >= 1
        assert {h // group for h in range(*s.q_heads)} == set(range(*s.kv_heads))
    assert [c for s in shards for c in range(*s.mlp)] == list(range(cfg.intermediate_size))
    assert [v for s in shards for v in range(*s.vocab)] == list(range(cfg.vocab_size))
    # MLP columns are cut on K-quant super-blocks when the width allows, else Q8_0 blocks
    unit = 256 if cfg.intermediate_size // 256 >= world else 32
    assert all(s.mlp[0] % unit == 0 for s in shards)


def test_smollm2_split_over_two_ranks():
    s0, s1 = (plan_shard(_model_cfg(9, 3), r, 2) for r in range(2))
    assert (s0.q_heads, s0.kv_heads, s1.q_heads, s1.kv_heads) == ((0, 3), (0, 1), (3, 9), (1, 3))
    assert (s0.mlp, s1.mlp, s0.vocab, s1.vocab) == ((0, 768), (768, 1536), (0, 24576),
                                                     (24576, 49152))
    local = shard_config(_model_cfg(9, 3), s1)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size,
            local.vocab_size) == (6, 2, 768, 24576)


@pytest.mark.parametrize("heads,kv,world", [(9, 3, 4), (4, 2, 3), (4, 4, 8)])
def test_splits_that_do_not_divide_are_refused(heads, kv, world):
    with pytest.raises(ValueError, match="do not split over"):
        plan_shard(_model_cfg(heads, kv), 0, world)


def test_quantised_columns_are_cut_on_blocks_or_dequantised():
    g = torch.Generator().manual_seed(0)
    w = quantize_ref(torch.randn(8, 256, generator=g), "q8_0")
    ref = dequantize_ref(w)
    sd = {"model.layers.0.self_attn.o_proj.weight": w,
          "model.layers.0.mlp.down_proj.weight": w}
    cfg = _model_cfg(4, 2, inter=256, vocab=96)
    shard = plan_shard(cfg, 1, 2)
    out = shard_state_dict(dict(sd), cfg, shard, torch.bfloat16)
    down = out["model.layers.0.mlp.down_proj.weight"]  # columns [128, 256): whole blocks
    assert down.qtype == "q8_0" and torch.equal(dequantize_ref(down), ref[:, 128:])
    o = out["model.layers.0.self_attn.o_proj.weight"]  # heads 2-3 of 64: columns [128, 256)
    assert torch.equal(dequantize_ref(o), ref[:, 128:])
    # a cut inside a block (head_dim 40: columns [80, 160) of Q8_0's 32-blocks): dequantised
    cfg40 = ModelConfig(**{**cfg.__dict__, "head_dim": 40})
    wk = quantize_ref(torch.randn(8, 160, generator=g), "q8_0")
    sd40 = {"model.layers.0.self_attn.o_proj.weight": wk}
    got = shard_state_dict(sd40, cfg40, plan_shard(cfg40, 1, 2), torch.float32)
    o40 = got["model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(o40, torch.Tensor) and torch.equal(o40, dequantize_ref(wk)[:, 80:])


def test_row_parallel_bias_stays_on_rank_zero_and_unknown_tensors_are_refused():
    cfg = _model_cfg(4, 2, inter=256, vocab=96)
    b = torch.arange(576.0)
    for rank, want in ((0, b), (1, torch.zeros(576))):
        out = shard_state_dict({"model.layers.0.self_attn.o_proj.bias": b}, cfg,
                               plan_shard(cfg, rank, 2), torch.float32)
        assert torch.equal(out["model.layers.0.self_attn.o_proj.bias"], want)
    with pytest.raises(ValueError, match="qkv_proj"):
        shard_state_dict({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(4, 4)}, cfg,
                         plan_shard(cfg, 0, 2), torch.float32)


# ---------------------------------------------------------------------------- settings


def test_cpu_sets():
    assert cpu_sets("none", 2) is None
    assert cpu_sets("auto", 2, available=[0, 1, 2, 3], numa_nodes=[[0, 1, 2, 3]]) == [[0, 1],
                                                                                        [2, 3]]
    assert cpu_sets("auto", 2, available=list(range(8)),
                    numa_nodes=[[0, 1, 4, 5], [2, 3, 6, 7]]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert cpu_sets("auto", 2, available=[0], numa_nodes=[[0]]) == [[0], [0]]
    assert cpu_sets("0-1,4;2", 2) == [[0, 1, 4], [2]]
    with pytest.raises(ValueError, match="expected 2"):
        cpu_sets("0-3", 2)
    with pytest.raises(ValueError, match="not a CPU"):
        cpu_sets("a;b", 2)


def test_parallel_settings_from_flags_and_config(tmp_path):
    p = add_serve_flags(argparse.ArgumentParser())
    cfg = serve_config(p.parse_args(["-tp", "2", "--nnodes", "2", "--node-rank", "1",
                                     "--dist-init-addr", "10.0.0.1:29500"]))
    par = cfg.engine.parallel
    assert (par.tensor_parallel_size, par.nnodes, par.node_rank) == (2, 2, 1)
    assert list(par.local_ranks) == [1]
    with pytest.raises(ValueError, match="dist-init-addr"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        ParallelConfig(tensor_parallel_size=2, dist_init_addr="nohost")
    doc = json.loads((__import__("pathlib").Path(__file__).parents[2]
                      / "examples" / "config.json").read_text())
    doc["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["worldSize"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    assert load_mindie_config(path).engine.parallel.tensor_parallel_size == 2
    doc["BackendConfig"]["npuDeviceIds"] = [[0, 1, 2]]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="worldSize"):
        load_mindie_config(path)


# ---------------------------------------------------------------------------- on ranks


def _steps(model: CausalLM, alone: bool) -> list[torch.Tensor]:
    """Prefill 11 + 5 tokens, then a 6-token chunk and a decode (seq 0 alone: its rows
    only); the fp32 logits of seq 0's rows of each step."""
    kv = model.allocate_kv_cache(num_blocks=8, block_size=BLOCK)
    tables = [[5, 2, 7], [0, 3]][:1 if alone else 2]
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 96, (17,), generator=g), torch.randint(3, 96, (6,), generator=g)]
    out = []
    for q_lens, done in (((11, 5), (0, 0)), ((6, 1), (11, 5))):
        n = len(tables)
        meta = AttentionMetadata.build(model.kernels, tables, list(q_lens[:n]), list(done[:n]),
                                       BLOCK)
        step = torch.cat([ids[s][done[s]:done[s] + q_lens[s]] for s in range(n)])
        hidden = model.forward(step, kv, meta)
        out.append(model.logits_at(hidden, list(range(q_lens[0]))))
    return out


def _shm(rank: int, world: int, shards, path: str) -> ShmCollectives:
    """The shared-memory collectives over ``path`` (rank 0 creates it; unlinked once
    every rank has it mapped)."""
    comm = ShmCollectives.open_group(rank, world, [s.vocab[1] - s.vocab[0] for s in shards],
                                     path, 1 << 16)
    assert comm is not None
    assert rank or not os.path.exists(path)  # rank 0 unlinked it after the barrier
    return comm


def _open_unmakeable(rank: int, world: int, path: str) -> bool:
    return ShmCollectives.open_group(rank, world, [1] * world, path, 1024) is None


def test_shm_group_falls_back_to_gloo_on_every_rank(tmp_path):
    """Rank 0 cannot create the segment: every rank gets None (the caller takes gloo),
    no rank waits for a path that never comes."""
    assert run_ranks(_open_unmakeable, 2, str(tmp_path / "no-such-dir" / "seg")) == [True,
                                                                                    True]


def _rank(rank: int, world: int, quant: str, dtype: torch.dtype, shm: str | None) -> dict:
    cfg = _cfg(True, wide=quant != "none")
    shards = _shards(cfg, world)
    comm = _shm(rank, world, shards, shm) if shm else None
    model = CausalLM.from_state_dict(cfg, _state_dict(cfg, quant), dtype, torch.device("cpu"),
                                     tp=_context(shards, rank, comm))
    assert model.decoder is None and model.cfg.num_heads == shards[rank].num_heads
    return {"batch": _steps(model, alone=False), "alone": _steps(model, alone=True)}


@pytest.mark.parametrize("quant,dtype,world,comm", [("none", torch.float32, 2, "gloo"),
                                                    ("q4_k", torch.bfloat16, 2, "shm"),
                                                    ("q8_0", torch.float32, 4, "shm")])
def test_ranks_compute_the_model_of_one_process(quant, dtype, world, comm, tmp_path):
    """Every rank ends with the same logits; they equal one process's up to the reduction
    order (fp32: 1e-4 of logits ~50; bf16 rows may flip an ulp); a row's logits do not
    depend on the other rows of the step (batch invariance: gloo at two ranks, the
    shared-memory path's fixed rank-order sum at any number)."""
    cfg = _cfg(True, wide=quant != "none")
    one = CausalLM.from_state_dict(cfg, _state_dict(cfg, quant), dtype, torch.device("cpu"))
    ref = _steps(one, alone=False)
    shm = f"/dev/shm/tokenserve-test-{tmp_path.name}" if comm == "shm" else None
    try:
        got = run_ranks(_rank, world, quant, dtype, shm)
    finally:
        if shm is not None and os.path.exists(shm):
            os.unlink(shm)
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(got[0]["batch"], got[r]["batch"]))
    tol = 1e-4 if dtype == torch.float32 and quant == "none" else 0.1
    for a, b in zip(ref, got[0]["batch"]):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < tol * max(1.0, a.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert all(torch.equal(a, b) for a, b in zip(got[0]["batch"], got[0]["alone"]))
