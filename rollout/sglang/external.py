"""External mode: servers (or an SGLang router) that the user already runs, used as they are."""

from __future__ import annotations

import logging
from typing import Sequence

import aiohttp

from rollout.client import normalize_url

logger = logging.getLogger(__name__)


def external_urls(urls: str | Sequence[str]) -> list[str]:
    """Normalise user-given URLs ("host:port", "http://host:port/", comma-separated) into base URLs."""
    if isinstance(urls, str):
        urls = urls.split(",")
    out = [normalize_url(url) for url in urls if url.strip()]
    if not out:
        raise ValueError("no engine URLs given")
    return out


async def register_with_router(router_url: str, worker_url: str, *, worker_type: str = "regular",
                               api_key: str | None = None, timeout_s: float = 30.0) -> None:
    """Add a worker to an sglang_router: POST /workers {"url", "worker_type"}, or /add_worker?url= on older routers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    base = external_urls(router_url)[0]
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        async with http.post(f"{base}/workers", json={"url": worker_url, "worker_type": worker_type}) as resp:
            if resp.status < 400:
                return
            if resp.status not in (404, 405):
                raise RuntimeError(f"router {base} refused worker {worker_url}: {resp.status} {await resp.text()}")
        logger.info("router %s has no /workers; using the older /add_worker", base)
        async with http.post(f"{base}/add_worker", params={"url": worker_url}) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"router {base} refused worker {worker_url}: {resp.status} {await resp.text()}")
