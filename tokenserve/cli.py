"""``tokenserve`` command line: ``serve`` (a model over MindIE-compatible HTTP APIs; with
``--role``, a prefill or decode instance of a PD cluster), ``coordinator`` (the PD
coordinator in front of prefill and decode instances) and ``bench`` (the serving benchmark)."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenserve.config.flags import add_coordinator_flags, add_serve_flags, serve_config
from tokenserve.config.tree import PdConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    # `bench` parses its own flags (tokenserve.loadgen.serving); main() hands it argv untouched
    sub.add_parser("bench", add_help=False, help="serving benchmark (see `tokenserve bench -h`)")
    s = sub.add_parser(
        "serve", help="serve a model over MindIE-compatible HTTP APIs",
        description="Flags override --config (a MindIE config.json; also found through "
                    "$MIES_CONFIG_JSON_PATH), which overrides the defaults shown.")
    add_serve_flags(s)
    from tokenserve.coordinator import app as coordinator_app

    add_coordinator_flags(sub.add_parser(
        "coordinator", help="PD coordinator in front of P and D instances",
        description=coordinator_app.__doc__.split("\n\n")[0]))
    return p


def _check_pd_extra(pd: PdConfig) -> None:
    """Load Mooncake now (with the port range, which it reads once, at load).

    Raises:
        ValueError: it is not installed or its library does not load.
    """
    from tokenserve.pd.kv_transfer import KvTransferError, load_mooncake

    try:
        load_mooncake(pd.kv_port_range)
    except KvTransferError as exc:
        raise ValueError(str(exc)) from None


def _bench(argv: list[str]) -> int:
    """``tokenserve bench``: the serving benchmark (:mod:`tokenserve.loadgen`); ``tokenserve
    bench kernels``: the kernel micro-benchmarks, ``python -m bench.kernels`` run in a
    repository checkout (a child process with the checkout as its working directory, so
    this process's import path stays as it is)."""
    if argv[:1] == ["kernels"]:
        import subprocess
        from pathlib import Path

        root = Path(__file__).resolve().parents[1]
        if not (root / "bench" / "kernels.py").is_file():
            print(f"tokenserve bench kernels needs a repository checkout: no bench/ package "
                  f"next to {root / 'tokenserve'} (install tokenserve editable from the "
                  f"repository)", file=sys.stderr)
            return 2
        try:
            return subprocess.call([sys.executable, "-m", "bench.kernels", *argv[1:]],
                                   cwd=root)
        except KeyboardInterrupt:  # the child got the same SIGINT and has stopped
            return 130
    try:
        from tokenserve.loadgen.serving import main as bench_main
    except ImportError as exc:
        print(f"tokenserve bench: {exc}; install the extra: pip install 'tokenserve[bench]' "
              f"(from a checkout: pip install -e '.[bench]')", file=sys.stderr)
        return 2
    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:  # one line per P<->D call otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "serve":
        try:
            cfg = serve_config(args)
            if cfg.pd.pd:  # before the model loads: a missing PD extra is one line
                _check_pd_extra(cfg.pd)
            from tokenserve.server.main import run_server

            return run_server(cfg)
        except (ValueError, FileNotFoundError) as exc:
            # start-up errors (bad flags or config, a port in use, a model that cannot
            # load): one line, exit status 2, no traceback
            print(f"tokenserve serve: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # a signal before the handlers were installed
            pass
        return 0
    if args.command == "coordinator":
        from tokenserve.coordinator.app import main as coordinator_main

        return coordinator_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
