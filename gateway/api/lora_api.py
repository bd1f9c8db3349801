"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies, plain-text
successes and status codes): the gateway XADDs a ``Control`` message to the model's control stream,
which every engine of that model reads; each engine loads (or unloads) the adapter between two
steps and reports the outcome under the message's ``op_id`` in its heartbeat, with its new set of
adapters. The gateway answers once every live engine of the model has reported (the first error,
if any), or 504 after ``LORA_TIMEOUT_S``. Engines that start later replay the control stream."""
from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from shared import names
from shared.protocol import Control, encode

from .api_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, validate
from .errors import APIError, bad_request
from .http_common import check_auth, gateway_of, read_body

LORA_TIMEOUT_S = 60.0


async def _request(request: Request, model: type):
    """The gateway and the body as `model`, once the API key checks out."""
    gw = gateway_of(request)
    check_auth(request)
    return gw, validate(model, await read_body(request, gw.config.max_body_bytes, gw.config.max_json_depth))


async def load_lora_adapter(request: Request) -> Response:
    try:
        gw, req = await _request(request, LoadLoRAAdapterRequest)
        model = _base_model(gw, req.model)
        name = req.lora_name
        if name in gw.models.adapters() or gw.models.get(name) is not None:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        await _run(gw, model, Control(uuid.uuid4().hex, "load_lora", name, req.lora_path))
    except APIError as e:
        return e.response()
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    try:
        gw, req = await _request(request, UnloadLoRAAdapterRequest)
        name = req.lora_name
        found = gw.models.adapters().get(name)
        if found is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_not_found")
        await _run(gw, found[0], Control(uuid.uuid4().hex, "unload_lora", name))
    except APIError as e:
        return e.response()
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _base_model(gw, requested: str | None):
    if requested is None:
        if len(gw.models.models) > 1:
            raise bad_request(f"this gateway serves several models ({', '.join(gw.models.models)}): name the "
                              "adapter's base model in 'model'", "model")
        return gw.models.default
    model = gw.models.get(requested)
    if model is None:
        raise APIError(404, f"The model '{requested}' does not exist", param="model", code="model_not_found")
    return model


async def _run(gw, model, control: Control) -> None:
    """Send `control` to the model's engines; return once each live one reports success."""
    if not model.view.live:
        raise APIError(503, f"no engine is serving model '{model.name}'; try again later", code="no_engine",
                       retry_after=max(1.0, gw.config.engine_timeout / 2))
    try:
        await gw.redis.xadd(names.control_stream(model.announced or model.name),
                            {names.PAYLOAD_FIELD: encode(control)}, maxlen=names.CONTROL_STREAM_MAXLEN,
                            approximate=True)
    except Exception as e:
        raise APIError(503, f"cannot reach the engines: Redis is unavailable ({type(e).__name__})",
                       code="redis_unavailable", retry_after=1.0) from None
    deadline = time.monotonic() + LORA_TIMEOUT_S
    while time.monotonic() < deadline:
        live = model.view.live
        results = [(e.heartbeat.get("control_results") or {}).get(control.op_id) for e in live]
        if live and all(isinstance(r, list) and len(r) == 2 for r in results):
            _verdict(control, results)
            return
        await asyncio.sleep(0.1)
    raise APIError(504, f"the engines of model '{model.name}' did not confirm {control.op} '{control.lora_name}' "
                        f"within {LORA_TIMEOUT_S:.0f} s", code="timeout")


def _verdict(control: Control, results: list[list]) -> None:
    """Raise the engines' error: for a load, any failure; for an unload, none removing it."""
    ok = [r for r in results if r[0] == 200]
    if control.op == "unload_lora":
        failed = [r for r in results if r[0] not in (200, 404)]
        if not failed and ok:
            return
        status, message = (failed or results)[0]
        raise APIError(int(status), str(message), param="lora_name",
                       code="lora_not_found" if status == 404 else "lora_error")
    if len(ok) == len(results):
        return
    status, message = next(r for r in results if r[0] != 200)
    where = f" ({len(ok)} of {len(results)} engines loaded it)" if ok else ""
    raise APIError(int(status) if int(status) in (400, 404) else 500, f"{message}{where}",
                   param="lora_path", code="lora_error")
