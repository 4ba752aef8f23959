"""The client tells when kube-apiserver is back: a call that found it away (no answer, or 503 while it
starts) makes the client ask ``/readyz`` until it answers 200, then call ``on_back`` once."""

from __future__ import annotations

import asyncio

import kubernetes
import pytest
from aiohttp import web

from mig_operator.kube.common import client as client_module
from mig_operator.kube.common.client import ApiError, KubeClient, Retry


def test_a_503_makes_the_client_wait_for_readyz_and_call_on_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "AWAY_POLL_S", 0.01)
    state = {"ready_after": 3, "readyz": 0}

    async def readyz(_: web.Request) -> web.Response:
        state["readyz"] += 1
        return web.Response(text="ok", status=200 if state["readyz"] >= state["ready_after"] else 503)

    async def starting(_: web.Request) -> web.Response:
        return web.json_response({"message": "not all paths installed"}, status=503)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/api/v1/nodes", starting)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        config = kubernetes.client.Configuration()
        config.host = f"http://127.0.0.1:{port}"
        kube = KubeClient(config, retry=Retry(attempts=1))
        back: list[bool] = []
        kube.on_back.append(lambda: back.append(True))
        try:
            with pytest.raises(ApiError) as refused:
                await kube.get("/api/v1/nodes")
            assert refused.value.status == 503
            assert kube.away
            for _ in range(300):
                if back:
                    break
                await asyncio.sleep(0.01)
            assert back == [True]
            assert state["readyz"] == state["ready_after"]  # asked until it said 200, then no more
            assert not kube.away
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())


def test_no_answer_at_all_counts_as_away_too() -> None:
    async def main() -> None:
        config = kubernetes.client.Configuration()
        config.host = "http://127.0.0.1:9"  # discard port: nothing listens
        kube = KubeClient(config, retry=Retry(attempts=1))
        try:
            with pytest.raises(ApiError) as refused:
                await kube.get("/api/v1/nodes")
            assert refused.value.status == 0
            assert kube.away
        finally:
            await kube.close()
        assert not kube.away  # closing stops asking

    asyncio.run(main())
