"""One long-lived ``GET /dresult`` per D (spec/pd_disaggregation.md §6.2, §10).

::

    connect GET /dresult (business port) --200--> link up: D usable for new requests
        chunks -> DresultParser -> on_message(D, msg) for request messages
                                   ka: ignored (it only keeps the read timeout alive)
                                   close: another consumer replaced us -> link down
    stream ends / read error / silent for dresult_idle_timeout_s -> link down:
        on_drop(D)  (every request in flight on D is recomputed elsewhere)
    re-link after relink_backoff_s, doubling up to relink_backoff_max_s; after
    max_retry failed attempts in a row the D is marked down (it stays out of
    scheduling until a link succeeds again)

Messages D writes while no stream is open are lost (§6.2), hence the recompute on drop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from tokenserve.api.routes import path_of
from tokenserve.config.tree import CoordinatorConfig
from tokenserve.coordinator.pool import Instance
from tokenserve.pd.wire import DMessage, DresultParser

logger = logging.getLogger(__name__)

OnMessage = Callable[[Instance, DMessage], None]
OnDrop = Callable[[Instance], None]


class DLink:
    """Keeps ``inst``'s ``/dresult`` stream open and hands its messages on.

    Args:
        inst: the D.
        client: the coordinator's upstream client.
        cfg: timeouts, back-off and ``max_retry``.
        on_message: called (synchronously) for each message that carries a request id.
        on_drop: called once each time an open stream ends.
    """

    def __init__(self, inst: Instance, client: httpx.AsyncClient, cfg: CoordinatorConfig,
                 on_message: OnMessage, on_drop: OnDrop) -> None:
        self._inst = inst
        self._client = client
        self._cfg = cfg
        self._on_message = on_message
        self._on_drop = on_drop
        self._quiet = False  # a failed link is logged at DEBUG (not the first in a row)

    async def run(self) -> None:
        """Link, relink with back-off, forever (until cancelled)."""
        cfg, inst = self._cfg, self._inst
        failures, pause = 0, cfg.relink_backoff_s
        while True:
            self._quiet = failures > 0  # one line per streak of failed links
            if await self._once():
                failures, pause = 0, cfg.relink_backoff_s
            else:
                failures += 1
                if failures > cfg.max_retry and not inst.down:
                    logger.warning("%s: /dresult re-link failed %d times, D marked down",
                                   inst.name, failures)
                    inst.down = True
            await asyncio.sleep(pause)
            pause = min(pause * 2, cfg.relink_backoff_max_s)

    async def _once(self) -> bool:
        """One stream, from connect to its end; True when it had opened."""
        inst, cfg = self._inst, self._cfg
        timeout = httpx.Timeout(cfg.dresult_idle_timeout_s, connect=cfg.connect_timeout_s)
        opened = False
        try:
            async with self._client.stream("GET", inst.addr.base_url + path_of("pd.dresult"),
                                           timeout=timeout) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread())[:200]
                    logger.log(logging.DEBUG if self._quiet else logging.WARNING,
                               "%s: /dresult answered %d %r", inst.name,
                               resp.status_code, body)
                    return False
                opened = True
                inst.link_up, inst.down = True, False
                logger.info("%s: /dresult linked", inst.name)
                await self._pump(resp)
        except (httpx.HTTPError, ValueError) as exc:
            if opened or not (isinstance(exc, httpx.ConnectError) or self._quiet):
                logger.warning("%s: /dresult failed: %r", inst.name, exc)
        finally:
            if opened:
                inst.link_up = False
                self._on_drop(inst)
        return opened

    async def _pump(self, resp: httpx.Response) -> None:
        """Parse the stream and dispatch until it ends or D closes it."""
        parser = DresultParser()
        async for chunk in resp.aiter_raw():
            for msg in parser.feed(chunk):
                if msg.kind == "close":
                    logger.warning("%s: /dresult closed by D: %s", self._inst.name, msg.body)
                    return
                if msg.req_id is not None and msg.kind != "ka":
                    self._on_message(self._inst, msg)
        logger.warning("%s: /dresult stream ended", self._inst.name)
