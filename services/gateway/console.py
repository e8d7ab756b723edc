"""The web console: a tenant's sessions, training runs, checkpoints and curves, served by the gateway's HTTP door.

Server-rendered HTML under ``/console`` (no build step, no script from elsewhere): a login form takes the API key
once and answers a cookie holding a signed, expiring token that names the tenant (``UrlSigner``, the key of the
gateway's download URLs), HttpOnly and SameSite=Strict; the key itself is never stored, in the cookie or in any
URL. Every page reads the core as the tenant's own requests do, so another tenant's run or checkpoint is not found.
A run's page draws one chart per metric its training steps reported (``ControlStore.run_points``: loss, gradient
norm, learning rate, ...), and a few lines of its own script add the new points every ``POLL_MS`` while it trains.
The overview adds the trainer pools' recent cycles, utilization and queue (``GatewayMetrics.pools``).
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from lathe.errors import LatheError, PermissionDenied, Unauthenticated

from .auth import ApiKeys
from .core import GatewayCore
from .downloads import UrlSigner

PREFIX = "/console"
COOKIE = "lathe_console"
SESSION_S = 12 * 3600  # a login lasts this long
POLL_MS = 2000
MAX_LOGIN_BYTES = 4096

STYLE = """
body{font:14px system-ui,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:10px 20px;display:flex;gap:20px;align-items:center}
header a{color:#cfd8e3;text-decoration:none} main{padding:16px 20px;max-width:1100px}
table{border-collapse:collapse;width:100%;background:#fff;margin-bottom:18px}
th,td{padding:6px 8px;border-bottom:1px solid #e3e6ea;text-align:left;font-size:13px} th{background:#eef1f4}
.charts{display:flex;flex-wrap:wrap;gap:14px} .chart{background:#fff;padding:8px;border:1px solid #e3e6ea}
.chart h3{margin:0 0 4px;font-size:13px} .muted{color:#6b7685} .err{color:#b00020}
"""

CHART_SCRIPT = """
const W=320,H=160,P=30;
function draw(svg,pts){
  const xs=pts.map(p=>p[0]),ys=pts.map(p=>p[1]);
  const x0=Math.min(...xs),x1=Math.max(...xs),y0=Math.min(...ys),y1=Math.max(...ys);
  const sx=x=>P+(x1>x0?(x-x0)/(x1-x0):0.5)*(W-2*P), sy=y=>H-P-(y1>y0?(y-y0)/(y1-y0):0.5)*(H-2*P);
  svg.setAttribute('data-points',pts.length);
  svg.innerHTML='<polyline fill="none" stroke="#2f6fdb" stroke-width="2" points="'
    +pts.map(p=>sx(p[0]).toFixed(1)+','+sy(p[1]).toFixed(1)).join(' ')+'"/>'
    +'<text x="2" y="12" font-size="10">'+y1.toPrecision(4)+'</text>'
    +'<text x="2" y="'+(H-P+4)+'" font-size="10">'+y0.toPrecision(4)+'</text>'
    +'<text x="'+P+'" y="'+(H-8)+'" font-size="10">step '+x0+'</text>'
    +'<text x="'+(W-P-40)+'" y="'+(H-8)+'" font-size="10">step '+x1+'</text>';
}
const series={}; let after=-1;
async function poll(){
  const r=await fetch(POINTS+'?after='+after,{credentials:'same-origin'});
  if(r.ok){
    for(const p of await r.json()){
      after=Math.max(after,p.seq_id);
      for(const [name,v] of Object.entries(p.metrics)){
        const key=p.op+' '+name; (series[key]=series[key]||[]).push([p.step,v]);
      }
    }
    const box=document.getElementById('charts');
    for(const key of Object.keys(series).sort()){
      const id='chart-'+key.replace(/[^a-z0-9]/gi,'-');
      let svg=document.getElementById(id);
      if(!svg){
        const div=document.createElement('div'); div.className='chart';
        div.innerHTML='<h3></h3><svg width="'+W+'" height="'+H+'"></svg>';
        div.querySelector('h3').textContent=key; svg=div.querySelector('svg'); svg.id=id; box.appendChild(div);
      }
      draw(svg,series[key]);
    }
    document.getElementById('points').textContent=after<0?'no steps yet':'';
  }
  setTimeout(poll,POLL_MS);
}
poll();
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "never"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(headers: list[str], rows: list[list[str]], empty: str) -> str:
    """An HTML table of already-escaped cells."""
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _page(title: str, body: str, tenant: str | None = None) -> HTMLResponse:
    nav = (f'<a href="{PREFIX}">Overview</a><span class="muted">{_e(tenant)}</span>'
           f'<a href="{PREFIX}/logout">Log out</a>') if tenant else ""
    return HTMLResponse(f'<!doctype html><html><head><meta charset="utf-8"><title>{_e(title)} - Lathe</title>'
                        f'<style>{STYLE}</style></head><body><header><b>Lathe console</b>{nav}</header>'
                        f"<main><h2>{_e(title)}</h2>{body}</main></body></html>")


def checkpoint_link(path: str) -> str:
    """The console page of the checkpoint at ``tinker://<run>/<kind>/<name>``, below the console's root."""
    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    return f"checkpoints/{quote(run, safe='')}/{quote(checkpoint_id, safe='/')}"


def _link(page: str, text: str) -> str:
    """A link to the console's ``page`` (below its root) that reads ``text``."""
    return f'<a href="{PREFIX}/{page}">{_e(text)}</a>'


def _run_link(model_id: str) -> str:
    return _link(f"training_runs/{quote(model_id, safe='')}", model_id)


class Console:
    """The ``/console`` routes over one core; ``app()`` is their ASGI application."""

    def __init__(self, core: GatewayCore, keys: ApiKeys, signer: UrlSigner) -> None:
        self.core, self.keys, self.signer = core, keys, signer

    def routes(self) -> list[BaseRoute]:
        """What the HTTP door mounts: ``/console`` itself, and the pages under it."""
        return [Route(PREFIX, lambda request: RedirectResponse(PREFIX + "/", status_code=303)),
                Mount(PREFIX, app=self.app())]

    def app(self) -> Starlette:
        page = self._logged_in
        return Starlette(routes=[
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["GET"]),
            Route("/", page(self.overview), methods=["GET"]),
            Route("/sessions/{session_id}", page(self.session), methods=["GET"]),
            Route("/training_runs/{run_id}", page(self.run), methods=["GET"]),
            Route("/training_runs/{run_id}/points", self._points, methods=["GET"]),
            Route("/checkpoints/{run_id}/{checkpoint_id:path}", page(self.checkpoint), methods=["GET"]),
        ])

    # ---- login ----

    def _tenant(self, request: Request) -> str:
        """The tenant the request's cookie names; ``Unauthenticated`` without a valid, unexpired one."""
        token = request.cookies.get(COOKIE)
        if not token:
            raise Unauthenticated("log in with your API key")
        try:
            tenant, what, _ = self.signer.verify(token)
        except PermissionDenied:
            raise Unauthenticated("your console login expired or is not valid: log in again") from None
        if what != "console":
            raise Unauthenticated("not a console login: log in again")
        return tenant

    async def login_form(self, request: Request, error: str = "") -> HTMLResponse:
        note = f'<p class="err">{_e(error)}</p>' if error else ""
        form = (f'{note}<form method="post" action="{PREFIX}/login"><label>API key '
                '<input type="password" name="api_key" autocomplete="off" autofocus></label> '
                '<button type="submit">Log in</button></form>')
        page = _page("Log in", form)
        page.status_code = 401 if error else 200
        return page

    async def login(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_LOGIN_BYTES:
            return await self.login_form(request, f"the login form is over {MAX_LOGIN_BYTES} bytes")
        key = (parse_qs(body.decode("utf-8", "replace")).get("api_key") or [""])[0].strip()
        try:
            tenant = self.keys.tinker_tenant(key or None)
            if not key:
                raise Unauthenticated("enter your API key")
        except LatheError as e:
            return await self.login_form(request, e.message)
        token = self.signer.sign(tenant, "console", "", int(time.time()) + SESSION_S)
        out = RedirectResponse(PREFIX + "/", status_code=303)
        out.set_cookie(COOKIE, token, max_age=SESSION_S, path=PREFIX, httponly=True, samesite="strict",
                       secure=request.url.scheme == "https")
        return out

    async def logout(self, request: Request) -> Response:
        out = RedirectResponse(PREFIX + "/login", status_code=303)
        out.delete_cookie(COOKIE, path=PREFIX)
        return out

    def _logged_in(self, fn: Callable[[Request, str], Awaitable[tuple[str, str]]]
                   ) -> Callable[[Request], Awaitable[Response]]:
        """A page of the logged-in tenant: ``fn`` gives its title and body; no login sends the login form."""
        async def endpoint(request: Request) -> Response:
            try:
                tenant = self._tenant(request)
            except Unauthenticated:
                return RedirectResponse(PREFIX + "/login", status_code=303)
            try:
                title, body = await fn(request, tenant)
            except LatheError as e:
                page = _page("Not available", f'<p class="err">{_e(e.message)}</p>', tenant)
                page.status_code = e.http_status
                return page
            return _page(title, body, tenant)

        return endpoint

    # ---- pages ----

    async def overview(self, request: Request, tenant: str) -> tuple[str, str]:
        runs, _ = self.core.registry.list_runs(tenant, 1000, 0)
        listed = await self.core.registry.list_checkpoints(tenant, "", 1000, 0)
        sessions = self.core.registry.list_sessions(tenant, 100, 0)
        pools = self.core.metrics.pools(self.core.ledger.pending_all())
        run_rows = [[_run_link(r.model_id), _e(r.base_model), _e(r.lora.rank), _when(r.last_request_time)]
                    for r in sorted(runs, key=lambda r: -r.created_at)]
        return "Overview", (
            "<h3>Training runs</h3>"
            + _table(["run", "base model", "rank", "last request"], run_rows, "no training runs yet")
            + "<h3>Checkpoints</h3>" + self._checkpoints(list(listed.checkpoints))
            + "<h3>Sessions</h3>" + _table(["session"], [[_link(f"sessions/{quote(s, safe='')}", s)] for s in sessions],
                                           "no sessions yet")
            + f"<h3>Trainer pools (last {pools.window_s:.0f} s, every tenant)</h3>"
            + _table(["clock cycles", "mean cycle", "utilization", "mean wait before a cycle", "queued now"],
                     [[str(pools.cycles), f"{pools.mean_cycle_s:.3f} s", f"{100 * pools.utilization:.1f}%",
                       f"{pools.mean_queued_s:.3f} s", str(pools.pending)]], ""))

    async def session(self, request: Request, tenant: str) -> tuple[str, str]:
        s, run_ids, sampler_ids = self.core.registry.session_members(tenant, request.path_params["session_id"])
        return f"Session {s.session_id}", (
            _table(["created", "display name", "metadata"], [[_when(s.created_at), _e(s.display_name or ""),
                                                             _e(json.dumps(s.user_metadata))]], "")
            + "<h3>Training runs</h3>" + _table(["run"], [[_run_link(r)] for r in run_ids], "no training runs")
            + "<h3>Sampling sessions</h3>" + _table(["sampler"], [[_e(x)] for x in sampler_ids], "no samplers"))

    @staticmethod
    def _checkpoints(checkpoints: list[Any]) -> str:
        rows = [[_link(checkpoint_link(c.tinker_path), c.tinker_path), _e(c.checkpoint_type),
                 _size(c.size_bytes), _when(c.time), _when(c.expires_at) if c.expires_at else "no TTL",
                 "published" if c.public else "private"]
                for c in sorted(checkpoints, key=lambda c: -c.time)]
        return _table(["path", "type", "size", "saved", "expires", "access"], rows, "no checkpoints yet")

    async def run(self, request: Request, tenant: str) -> tuple[str, str]:
        run = self.core.runs.get(tenant, request.path_params["run_id"])
        listed = await self.core.registry.list_checkpoints(tenant, run.model_id, 0, 0)
        points = f"{PREFIX}/training_runs/{quote(run.model_id, safe='')}/points"
        info = _table(["base model", "LoRA rank", "optimizer", "created", "last request"],
                      [[_e(run.base_model), _e(run.lora.rank), _e(run.optimizer), _when(run.created_at),
                        _when(run.last_request_time)]], "")
        script = (f"<script>const POINTS={json.dumps(points)}, POLL_MS={POLL_MS};{CHART_SCRIPT}</script>")
        return f"Training run {run.model_id}", (
            info + '<h3>Curves</h3><p id="points" class="muted">loading</p><div id="charts" class="charts"></div>'
            + "<h3>Checkpoints</h3>" + self._checkpoints(list(listed.checkpoints)) + script)

    async def _points(self, request: Request) -> Response:
        """The run's curve points after ``?after=<seq_id>`` as JSON (what the run page's script polls)."""
        try:
            tenant = self._tenant(request)
            run = self.core.runs.get(tenant, request.path_params["run_id"])
            after = int(request.query_params.get("after", "-1"))
        except LatheError as e:
            return JSONResponse({"error": e.message}, e.http_status)
        except ValueError:
            return JSONResponse({"error": "after must be an integer"}, 400)
        return JSONResponse(self.core.store.run_points(tenant, run.model_id, after))

    async def checkpoint(self, request: Request, tenant: str) -> tuple[str, str]:
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        info = await self.core.lookups.checkpoint(tenant, path)
        meta = json.loads(info.metadata_json or "{}")
        rows = [["path", _e(info.path)], ["kind", _e(info.kind)], ["size", _size(info.size_bytes)],
                ["saved", _when(info.created_at)],
                ["expires", _when(info.expires_at) if info.expires_at else "no TTL"],
                ["access", "published" if info.public else "private"],
                ["training run", _run_link(info.run_id)]]
        rows += [[_e(k), _e(v if isinstance(v, str) else json.dumps(v))] for k, v in sorted(meta.items())]
        return f"Checkpoint {info.kind}/{info.name}", _table(["field", "value"], rows, "")
