"""The one client for a fleet of OpenAI-compatible servers serving one model: health, probes,
least-loaded balancing, failover, the breaker, retries with backoff and per-attempt deadlines.

Two protocols ride on it: regenerate's chat completions (generation/fleet.py, `OpenAIBackend`)
and the hidden-states completions of vLLM's `extract_hidden_states` servers (states_server.py,
for extract and online training). A subclass says where a request goes (`route`), how one
attempt is read (`_attempt`: a result, or `Retry` for a failure worth retrying) and what a failed
request becomes (`_failed`); everything about the servers is here, once."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from dflash_etl.core.errors import StageError
from dflash_etl.models.http import Retry, list_models

BREAK_AFTER = 3  # failed requests, with none served, that take a server out for the stage


class FleetSettings(Protocol):
    """The limits every fleet client reads (regenerate's, extract's and train's settings)."""

    concurrency: int  # requests in flight per server
    timeout_s: float  # each read and the connect
    request_deadline_s: float  # one attempt in all
    retries: int
    cooldown_s: float  # a failed server's rest before its probe

    @property
    def servers(self) -> tuple[str, ...]: ...


class _Server:
    """One server of the fleet, and what the dispatcher knows of it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0
        self.served = 0  # replies it gave (of this client's requests)
        self.healthy = True
        self.probing = False
        self.probes_failed = 0  # failed probes since it was taken out
        self.retry_at = 0.0  # time.monotonic() of its next probe, while it is out
        self.problem = ""  # why it was taken out
        self.probe_problem = ""  # why its last probe failed
        self.failed = 0  # requests it failed in a row in one way (failure_kind), after retries
        self.failure_kind = ""
        self.broken = False  # out for the rest of the stage (the breaker: see _count_failure)
        self.use = _Use()  # what it was sent and served, and how busy it was (server_figures)

    def why(self) -> str:
        return f"{self.url}: {self.problem}" + (
            f"; then {self.probe_problem}" if self.probe_problem else "")


class _Use:
    """One server's load, for the stats (apart from `_Server`'s counts, which the breaker and
    failover read): requests sent, served, failed, and over the time the fleet had any request
    outstanding (`active_s`, the fleet's) the integral of its requests in flight and the time it
    had one at least. Reset by `Fleet.take_use` (extract: per shard)."""

    def __init__(self) -> None:
        self.requests = self.served = self.failed = 0
        self.in_flight_s = self.busy_s = 0.0


def use_figures(totals: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per server URL: requests, served, failed, the time-weighted mean of its requests in
    flight while the fleet was working and the share of that time it had one at least, from
    `Fleet.take_use`'s raw totals (several of them added up by `add_use`)."""
    return {url: {"requests": t["requests"], "served": t["served"], "failed": t["failed"],
                  "mean_in_flight": round(t["in_flight_s"] / t["active_s"], 3)
                  if t["active_s"] else 0.0,
                  "busy_share": round(t["busy_s"] / t["active_s"], 4) if t["active_s"] else 0.0}
            for url, t in totals.items()}


def add_use(into: dict[str, dict[str, Any]], totals: dict[str, dict[str, Any]]) -> None:
    """`totals` (one `take_use`'s) added to `into`, server by server."""
    for url, t in totals.items():
        mine = into.setdefault(url, dict.fromkeys(t, 0))
        for key, value in t.items():
            mine[key] += value


class Fleet:
    """One server or several serving one model. Async requests with bounded concurrency (per
    server), per-request timeouts and retries with exponential backoff; results come back in
    request order whatever order, and whatever server, they finish on.

    With several servers each request goes to the healthy server with the fewest requests in
    flight (ties in turn). A server that fails a request (refused connection; reset, timeout,
    429 or 5xx after `retries`) is taken out and the request goes to another; an out server is
    probed (GET /models) after `cooldown_s` and comes back when it answers with the fleet's
    models. When no server is left a request waits at most one probe round for one to come
    back, then fails (`_failed`, a counted row): no wait is without a deadline. With one
    server, failures stay per request (retried, then the row fails)."""

    route = ""  # the request's path under a server's /v1 base
    client_name = "fleet"  # in the message of a request the client itself failed

    def __init__(self, settings: FleetSettings, served_model: str | None) -> None:
        import httpx

        self.settings = settings
        self.httpx = httpx
        self.servers = [_Server(url) for url in settings.servers]
        if not self.servers:
            raise StageError("no server to send requests to: pass --endpoint URL (a server's "
                             "/v1 base) or --endpoints URL,URL")
        self.base = self.servers[0].url
        self.fleet = len(self.servers) > 1  # health tracking and failover
        self.probe_timeout_s = min(settings.timeout_s, 5.0)
        self.retried = 0
        self.failovers = 0  # requests moved to another server after theirs failed
        self._turn = 0  # round-robin position among equally loaded servers
        self.active_s = 0.0  # time with any request in flight (for `_Use`'s means)
        self._ticked = time.monotonic()
        self.listed: list[str] = []
        # made once: building it per batch (httpx's default) cost ~90 ms a batch on a busy
        # machine, more than the requests of a small batch
        self.tls = httpx.create_ssl_context() if hasattr(httpx, "create_ssl_context") else True
        name = served_model
        if self.fleet:
            name = self._check_fleet(name)
        elif name is None:
            try:
                name = list_models(httpx, self.base, settings.timeout_s,
                                    settings.request_deadline_s)[0]
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
                raise StageError(f"cannot list the models of {self.base}/models ({exc}): is the "
                                 "server running? Pass --served-model to skip the lookup") from exc
        self.served_model: str = name

    # ------------------------------------------------------------ what a subclass says
    async def _attempt(self, client: Any, url: str, body: dict[str, Any]) -> Any:
        """One attempt's result (a reply, or the request's own error: no other server would
        take it); raises Retry for a failure worth retrying."""
        raise NotImplementedError

    def _failed(self, problem: str) -> Any:
        """What a request that no server answered becomes (its row's failure, with why)."""
        raise NotImplementedError

    # ------------------------------------------------------------ the fleet's models
    def _models(self, url: str) -> list[str]:
        return list_models(self.httpx, url, self.probe_timeout_s,
                            min(self.settings.request_deadline_s, self.probe_timeout_s + 1.0))

    def _check_fleet(self, name: str | None) -> str:
        """Every server that answers must list the same models; those that do not answer yet
        start out of the fleet (probed later). Returns the served model name."""
        listed: dict[str, list[str]] = {}
        for server in self.servers:
            try:
                listed[server.url] = self._models(server.url)
            except (self.httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                self._take_out(server, f"did not list its models at the start: "
                                       f"{type(exc).__name__}: {exc}")
        if not listed:
            raise StageError("cannot list the models of any of --endpoints "
                             f"{[s.url for s in self.servers]}: "
                             + " | ".join(s.why() for s in self.servers))
        kinds = {tuple(sorted(ids)) for ids in listed.values()}
        if len(kinds) > 1:
            raise StageError("the --endpoints do not serve the same models: " + "; ".join(
                f"{url} lists {ids}" for url, ids in listed.items())
                + ". A fleet must serve one model (the replies would depend on the server)")
        self.listed = sorted(next(iter(kinds)))
        first = next(iter(listed.values()))
        if name is None:
            if not first:
                raise StageError(f"{next(iter(listed))}/models lists no model")
            return first[0]
        if name not in self.listed:
            raise StageError(f"--served-model {name!r} is not served by the --endpoints "
                             f"{list(listed)} (they list {self.listed})")
        return name

    # ------------------------------------------------------------ requests
    def send(self, bodies: list[dict[str, Any]]) -> list[Any]:
        """Every body's result, in order (blocking: an event loop of its own per call)."""
        import asyncio

        return asyncio.run(self._send_all(bodies))

    async def _send_all(self, bodies: list[dict[str, Any]]) -> list[Any]:
        import asyncio

        changed = asyncio.Condition()  # in-flight counts and health: the dispatcher's state
        for server in self.servers:  # an interrupted batch may have left counts behind
            server.in_flight, server.probing = 0, False
        self._ticked = time.monotonic()  # the time between batches is nobody's
        limits = self.httpx.Limits(max_connections=self.settings.concurrency * len(self.servers))
        async with self.httpx.AsyncClient(timeout=self.settings.timeout_s, limits=limits,
                                          verify=self.tls) as client:
            probes: set[asyncio.Task] = set()
            self._probe_due(client, changed, probes)  # before any request picks a server
            prober = asyncio.create_task(self._prober(client, changed, probes))
            # the fleet's slots: few requests wait on `changed` (only while servers are out)
            gate = asyncio.Semaphore(self.settings.concurrency * len(self.servers))

            async def one(body: dict[str, Any]) -> Any:
                async with gate:
                    try:
                        return await self._dispatch(client, changed, body)
                    except Exception as exc:  # one request never takes its batch down
                        return self._failed(f"the {self.client_name} client failed on this "
                                            f"request: {type(exc).__name__}: {exc}")

            try:
                return list(await asyncio.gather(*(one(b) for b in bodies)))
            finally:
                prober.cancel()
                for task in (prober, *probes):
                    task.cancel()
                await asyncio.gather(prober, *probes, return_exceptions=True)

    async def _dispatch(self, client: Any, changed: Any, body: dict[str, Any]) -> Any:
        """One request: a server, then another while servers fail, until a reply or none is
        left."""
        tried: dict[int, str] = {}  # server -> how it failed this request
        while True:
            picked = await self._acquire(changed, tried)
            if picked is None:
                return self._failed(self._no_server(tried))
            k, server = picked
            try:
                reply, problem, _ = await self._request(client, server, body, changed)
            finally:
                async with changed:
                    self._tick()
                    server.in_flight -= 1
                    changed.notify_all()
            if reply is not None:
                server.served += 1
                server.use.served += 1
                return reply
            server.use.failed += 1
            if not self.fleet:
                return self._failed(problem)
            tried[k] = problem
            async with changed:
                self._take_out(server, problem)
                changed.notify_all()
            self.failovers += 1

    def _count_failure(self, server: _Server, problem: str, kind: str | None) -> None:
        """The breaker: a server that has failed BREAK_AFTER attempts in the same way and served
        none (a slow-loris or endless stream past its deadline or its size cap, a 503 for
        everything, a refused connection) is out for the rest of the stage, one server or a
        fleet: the attempts left fail at once instead of each waiting out its retries x
        request_deadline_s (33 rows took 100 min; counting requests after all their attempts
        still cost (retries + 1) x the deadline). A malformed reply (kind None) is that reply's
        problem, not the server's."""
        if kind is None:
            return
        server.failed = server.failed + 1 if kind == server.failure_kind else 1
        server.failure_kind = kind
        if not server.broken and server.served == 0 and server.failed >= BREAK_AFTER:
            server.broken, server.healthy = True, False
            server.problem = (f"failed its first {server.failed} attempts ({kind}) and answered "
                              f"none, so it is out for the rest of the stage; the last: "
                              f"{problem}")

    def _no_server(self, tried: dict[int, str]) -> str:
        n = len(self.servers)
        if all(s.broken for s in self.servers):
            return (f"every server of the {n} --endpoints is out: "
                    + " | ".join(s.why() for s in self.servers))
        if len(tried) == n:
            return f"failed on every one of the {n} --endpoints: " + " | ".join(tried.values())
        down = " | ".join(s.why() for k, s in enumerate(self.servers) if k not in tried)
        failed = "".join(f" | this request: {p}" for p in tried.values())
        return (f"no server of the {n} --endpoints is up (waited one probe round, cooldown_s="
                f"{self.settings.cooldown_s:g}): {down}{failed}")

    async def _acquire(self, changed: Any, tried: dict[int, str]) -> tuple[int, _Server] | None:
        """The least-loaded healthy server this request has not failed on (ties in turn), its
        in-flight count taken; None when there is none to wait for. Waits for a free slot (freed
        by requests that have their own timeouts) or, when every server is out, at most one probe
        round for one to come back."""
        import asyncio

        n, cap, deadline = len(self.servers), self.settings.concurrency, None
        async with changed:
            while True:
                left = [k for k in range(n) if k not in tried and not self.servers[k].broken]
                if not left:
                    return None
                free = [k for k in left
                        if self.servers[k].healthy and self.servers[k].in_flight < cap]
                if free:
                    low = min(self.servers[k].in_flight for k in free)
                    k = min((k for k in free if self.servers[k].in_flight == low),
                            key=lambda k: (k - self._turn) % n)
                    self._turn = (k + 1) % n
                    self._tick()
                    self.servers[k].in_flight += 1
                    self.servers[k].use.requests += 1
                    return k, self.servers[k]
                wait = 1.0  # re-checked at least this often
                if not any(self.servers[k].healthy for k in left):
                    # out servers worth waiting for: probed now, or not probed yet since they
                    # were taken out (a server whose probe failed is not waited for again)
                    coming = [k for k in left if self.servers[k].probing
                              or self.servers[k].probes_failed == 0]
                    if not coming:
                        return None
                    if deadline is None:
                        deadline = (time.monotonic() + self.settings.cooldown_s
                                    + self.probe_timeout_s + 1.0)
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), wait)

    def _tick(self) -> None:
        """The time since the last change of an in-flight count, added to the load figures
        (called before every change)."""
        now = time.monotonic()
        elapsed, self._ticked = now - self._ticked, now
        if any(s.in_flight for s in self.servers):
            self.active_s += elapsed
            for server in self.servers:
                server.use.in_flight_s += server.in_flight * elapsed
                server.use.busy_s += elapsed if server.in_flight else 0.0

    def take_use(self, reset: bool = True) -> dict[str, dict[str, Any]]:
        """Per server URL, the raw load totals since the last reset (`use_figures` turns them
        into means and shares; `add_use` adds up several): requests, served, failed,
        in_flight_s, busy_s and the fleet's active_s."""
        totals = {s.url: {**vars(s.use), "active_s": self.active_s} for s in self.servers}
        if reset:
            self.active_s = 0.0
            for server in self.servers:
                server.use = _Use()
        return totals

    def broken_servers(self) -> list[str]:
        """The servers the breaker took out, each with why (for the stage's warnings)."""
        return [f"{s.url} {s.problem}" for s in self.servers if s.broken]

    def server_figures(self) -> dict[str, dict[str, Any]]:
        """Per server URL since the last reset: requests, served, failed, mean_in_flight and
        busy_share (`use_figures`)."""
        return use_figures(self.take_use(reset=False))

    def _take_out(self, server: _Server, problem: str) -> None:
        if server.healthy:
            server.healthy = False
            server.probes_failed = 0
            server.retry_at = time.monotonic() + self.settings.cooldown_s
            server.problem, server.probe_problem = problem, ""

    # ------------------------------------------------------------ probes
    def _probe_due(self, client: Any, changed: Any, probes: set[Any]) -> None:
        import asyncio

        now = time.monotonic()
        for server in self.servers:
            if (not server.healthy and not server.broken and not server.probing
                    and server.retry_at <= now):
                server.probing = True
                task = asyncio.create_task(self._probe(client, changed, server))
                probes.add(task)
                task.add_done_callback(probes.discard)

    async def _prober(self, client: Any, changed: Any, probes: set[Any]) -> None:
        import asyncio

        if not self.fleet:
            return
        while True:
            await asyncio.sleep(min(0.2, self.settings.cooldown_s / 2))
            self._probe_due(client, changed, probes)

    async def _probe(self, client: Any, changed: Any, server: _Server) -> None:
        """GET /models: the server comes back when it answers with the fleet's models."""
        import asyncio

        problem = ""
        try:
            async with asyncio.timeout(self.probe_timeout_s + 1.0):  # a trickle ends too
                response = await client.get(f"{server.url}/models",
                                            timeout=self.probe_timeout_s)
            response.raise_for_status()
            ids = sorted(m["id"] for m in response.json()["data"])
            if ids != self.listed:
                problem = f"now lists {ids}, not the fleet's {self.listed}"
        except (self.httpx.HTTPError, KeyError, TypeError, ValueError, TimeoutError) as exc:
            problem = f"probe failed: {type(exc).__name__}: {exc}"
        finally:
            server.probing = False  # also when cancelled: the next batch probes it again
        async with changed:
            if problem:
                server.probes_failed += 1
                server.retry_at = time.monotonic() + self.settings.cooldown_s
                server.probe_problem = problem
            else:
                server.healthy, server.probes_failed = True, 0
                server.problem = server.probe_problem = ""
            changed.notify_all()

    async def _request(self, client: Any, server: _Server, body: dict[str, Any],
                       changed: Any) -> tuple[Any, str, str | None]:
        """(result, "", None) — a reply, or the request's own error (HTTP 4xx: no other server
        would take it) — or (None, problem, kind) when the server failed it after its retries
        (kind: how, for the breaker; None for a malformed reply): timeouts, connection errors,
        429 and 5xx, a reply past `request_deadline_s` or past its size cap, and malformed
        replies. In a fleet a refused connection fails over at once: nothing listens there."""
        import asyncio

        url = f"{server.url}{self.route}"
        deadline = self.settings.request_deadline_s
        problem, kind, refused = "", None, False
        for attempt in range(self.settings.retries + 1):
            if attempt:
                async with changed:  # every failed attempt counts for the breaker
                    self._count_failure(server, problem, kind)
                    changed.notify_all()
                if server.broken:
                    return None, f"{url}: {server.problem}", kind
                self.retried += 1
                await asyncio.sleep(min(0.25 * 2 ** (attempt - 1), 8.0))
            try:
                async with asyncio.timeout(deadline):
                    return await self._attempt(client, url, body), "", None
            except Retry as exc:
                problem, kind = str(exc), exc.kind
            except TimeoutError:
                problem = (f"no complete reply within request_deadline_s={deadline:g} s "
                           "(connect, first byte and the whole reply)")
                kind = "deadline"
            except (self.httpx.TimeoutException, self.httpx.TransportError) as exc:
                problem, kind = f"{type(exc).__name__}: {exc}", type(exc).__name__
                refused = self.fleet and isinstance(exc, self.httpx.ConnectError)
                if refused:  # nothing listens there: fail over at once
                    break
            except self.httpx.HTTPError as exc:  # decoding, protocol: the reply is unusable
                problem, kind = f"{type(exc).__name__}: {exc}", None
        async with changed:
            self._count_failure(server, problem, kind)
            changed.notify_all()
        if refused:
            return None, f"{url}: {problem}", kind
        return None, (f"{url} failed after {self.settings.retries + 1} attempts; "
                      f"last: {problem}"), kind
