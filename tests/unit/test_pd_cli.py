"""PD settings from the command line and config.json (``tokenserve serve --role ...``)."""

from __future__ import annotations

import json

import pytest

from tokenserve.cli import build_parser, serve_config


def _cfg(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_role_implies_dmi_and_the_host_is_advertised():
    pd = _cfg("--role", "decode", "--host", "10.1.2.3", "--kv-trans-timeout", "3").pd
    assert (pd.infer_mode, pd.role, pd.ip_address, pd.kv_trans_timeout_s) == \
        ("dmi", "decode", "10.1.2.3", 3.0)
    assert _cfg().pd.infer_mode == "standard" and _cfg().pd.role is None


def test_all_interfaces_need_an_advertised_address():
    with pytest.raises(ValueError, match="--advertise-ip"):
        _cfg("--role", "prefill", "--host", "0.0.0.0")
    pd = _cfg("--role", "prefill", "--host", "0.0.0.0", "--advertise-ip", "10.0.0.1").pd
    assert pd.ip_address == "10.0.0.1"
    assert _cfg("--host", "0.0.0.0").pd.infer_mode == "standard"  # mixed: no address needed


def test_config_json_infer_mode_and_kv_trans_timeout(tmp_path):
    doc = {"ServerConfig": {"inferMode": "dmi", "ipAddress": "10.0.0.7"},
           "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
               {"modelName": "m", "kv_trans_timeout": 0}]}}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    cfg = _cfg("--config", str(path), "--infer-mode", "dmi")
    assert cfg.pd.infer_mode == "dmi" and cfg.pd.ip_address == "10.0.0.7"
    assert cfg.pd.kv_trans_timeout_s == 1.0 == cfg.engine.kv_trans_timeout_s  # <= 0 -> 1


def test_kv_port_range_flag():
    """``--kv-port-range`` bounds Mooncake's listeners (firewalls); checked at parse."""
    assert _cfg("--role", "decode", "--kv-port-range", "16000-16100").pd.kv_port_range == \
        (16000, 16100)
    assert _cfg("--role", "decode").pd.kv_port_range is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-port-range", "16000"])
    for bad in ("900-1000", "16100-16000", "16000-16000", "60000-70000"):
        with pytest.raises(ValueError, match="kv port range"):
            _cfg("--role", "decode", "--kv-port-range", bad)


def test_pd_without_mooncake_is_one_line_and_exit_2_before_the_model_loads(monkeypatch, capsys):
    import sys

    import tokenserve.server.main as app
    from tokenserve.cli import main

    def run_server(cfg):
        raise AssertionError("the server (and the model) started before the check")

    monkeypatch.setattr(app, "run_server", run_server)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails, as uninstalled
    assert main(["serve", "--role", "prefill", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "pip install 'tokenserve[pd]'" in err and "libibverbs1" in err and "libnuma1" in err
