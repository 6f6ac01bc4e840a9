"""Structured output at the edge: the request field that asks for it, as `StructuredOutputsParams`.

A client may ask with OpenAI's `response_format`, vLLM's `structured_outputs` object, or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; one request may use one of them.
`compile_constraint` compiles the grammar on a tokenizer thread before the request is submitted (the
params then hold it, so `make_request`, on the event loop, never compiles), and reports a bad schema,
regex or grammar as a 400 whose `param` is the field the client sent. What this module does not own:
tool calls' grammars (`tools.py`), holding the output to a grammar (the engine,
`jaxserve/core/structured_output.py`).
"""

from __future__ import annotations

import logging

from jaxserve.errors import InvalidParameter
from jaxserve.config.sampling_params import StructuredOutputsParams
from server.admission import ServerState
from server.errors import APIError
from server.protocol import SamplingFields

logger = logging.getLogger(__name__)
# vLLM's names for the backend jaxserve uses; any other backend would give other outputs
LLGUIDANCE_BACKENDS = ("auto", "guidance", "llguidance")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class Constraint:
    """A request's structured output and the field it came from (the `param` of its errors)."""

    def __init__(self, params: StructuredOutputsParams, field: str):
        self.params, self.field = params, field


def requested_constraint(body: SamplingFields) -> Constraint | None:
    """The structured output `body` asks for, or None; two ways of asking at once are a 400."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS) if _asks(body, name)]
    backend = body.guided_decoding_backend
    if backend is not None and backend not in LLGUIDANCE_BACKENDS:
        raise APIError(400, f"guided_decoding_backend {backend!r} is not available: jaxserve compiles every grammar "
                            f"with llguidance (give one of {', '.join(LLGUIDANCE_BACKENDS)} or leave it out)",
                       "guided_decoding_backend")
    if not given:
        if body.guided_whitespace_pattern is not None:
            raise APIError(400, "guided_whitespace_pattern applies to JSON output; give a schema too",
                           "guided_whitespace_pattern")
        return None
    if len(given) > 1:
        raise APIError(400, f"give one of response_format, structured_outputs and guided_*; got {' and '.join(given)}",
                       given[1])
    field = given[0]
    try:
        params = _params(body, field)
    except InvalidParameter as e:
        raise APIError(400, _renamed(str(e), field), field) from None
    if params.whitespace_pattern is not None and params.kind not in ("json", "json_object"):
        where = "guided_whitespace_pattern" if body.guided_whitespace_pattern is not None else field
        raise APIError(400, f"a whitespace pattern applies to JSON output, not to a {params.kind}", where)
    return Constraint(params, field)


def _asks(body: SamplingFields, name: str) -> bool:
    value = getattr(body, name)
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None


def _params(body: SamplingFields, field: str) -> StructuredOutputsParams:
    if field == "response_format":
        fmt = body.response_format
        whitespace = body.guided_whitespace_pattern
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, whitespace_pattern=whitespace)
        if fmt.json_schema is None:
            raise InvalidParameter(field, "response_format of type json_schema needs a json_schema object")
        return StructuredOutputsParams(json=fmt.json_schema.schema_, whitespace_pattern=whitespace)
    if field == "structured_outputs":
        so = body.structured_outputs
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                                       whitespace_pattern=so.whitespace_pattern)
    kind = field.removeprefix("guided_")
    return StructuredOutputsParams(**{kind: getattr(body, field)}, whitespace_pattern=body.guided_whitespace_pattern)


def _renamed(message: str, field: str) -> str:
    """The engine's message speaks of `structured_outputs`; the client may have sent another field."""
    if field == "structured_outputs":
        return message
    return message.replace("structured_outputs needs", f"{field} needs")


async def compile_constraint(state: ServerState, constraint: Constraint, where: str | None = None) -> None:
    """Compiles the constraint off the event loop (its params hold the result until admission); a bad one
    is a 400 whose param is its field and whose message starts with `where` in the request (default: the
    field)."""
    field, where = constraint.field, where or constraint.field
    try:
        await state.run_blocking(state.engine.grammars.compile, constraint.params)
    except InvalidParameter as e:
        raise APIError(400, f"{where}: {_renamed(str(e), field)}", field) from None
    except Exception as e:  # noqa: BLE001 - the client's schema or grammar made the compiler fail
        logger.warning("compiling the %s of a request failed", where, exc_info=e)
        raise APIError(400, f"{where}: cannot compile this {constraint.params.kind} ({type(e).__name__})",
                       field) from None
