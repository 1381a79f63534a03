"""OpenAI tool calling, the request side: ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` validated, the prompt (the model's chat template, or our default
tool prompt), and the grammar that constrains the answer (spec/interfaces.md §5.1, §5.5;
OpenAI API reference, Chat Completions: ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``message.tool_calls``).

The tool-call text is the served model's own (:mod:`tokenserve.api.openai.tool_formats`:
Hermes/Qwen, Llama 3.x, Mistral, Granite, chosen from the chat template's text). The
default, Hermes/Qwen's, which SmolLM2 and most small instruct models have seen, writes
each call as one line of JSON between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls are separated by one newline. :mod:`tokenserve.api.openai.toolparse` turns
that text back into ``tool_calls``.

Constraints ([I], built here, enforced by the engine through
``SamplingParams.structured``, llguidance's Lark dialect with ``%json`` for each tool's
``parameters``):

- ``required``: one call (or, with ``parallel_tool_calls``, one or more) of any tool;
- a named tool: exactly one call of that tool (as vLLM: ``parallel_tool_calls`` does
  not apply);
- ``auto``: either free text that does not start with ``<tool_call>``, or tool calls only
  (so an answer is text or calls, never both);
- ``none``: no constraint; the tools are left out of the prompt and the output is not
  parsed.

Errors are ``ValueError`` (the family answers 422).
"""

# ValueError, not TypeError, is the contract of every parser here (the family answers 422).
# ruff: noqa: TRY004

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
import jsonschema
import jsonschema.exceptions

from tokenserve.api.openai.tool_formats import HERMES, ToolFormat
from tokenserve.api.structured import closed_objects
from tokenserve.sampling_params import ConstraintKind, StructuredOutput

#: [I] most tools one request may list (a grammar over 128 tools still compiles in
#: milliseconds; the bound keeps prompts and grammars of one request bounded).
MAX_TOOLS = 128
#: JSON under the grammar: no flexible whitespace, OpenAI's separators (spec §5.5).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: a tool without ``parameters`` takes none (OpenAI: "omitting parameters defines a
#: function with an empty parameter list").
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}


@dataclass(frozen=True)
class ToolChoice:
    """What the request asks of the tools.

    Attributes:
        tools: the request's ``tools`` as sent (``{type: function, function: {...}}``).
        mode: ``none`` | ``auto`` | ``required`` | ``named``.
        name: the named tool (mode ``named``), else None.
        parallel: ``parallel_tool_calls`` (OpenAI default true): more than one call allowed.
    """

    tools: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """True when tools go into the prompt and the output is parsed for calls."""
        return self.mode != "none"

    def offered(self) -> list[dict[str, Any]]:
        """The tools the model may call (the named one alone for mode ``named``)."""
        if self.mode == "named":
            return [t for t in self.tools if t["function"]["name"] == self.name]
        return list(self.tools)


def parse_tool_choice(obj: dict[str, Any]) -> ToolChoice | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body (spec §5.1).

    The shapes themselves were checked by :func:`protocol.parse_tools`. Here: at most
    :data:`MAX_TOOLS` tools, names unique, each ``parameters`` a valid JSON Schema (any
    draft ``jsonschema`` knows) of an object; a named ``tool_choice`` names a listed tool;
    ``required`` or a named tool need ``tools``. ``tool_choice`` defaults to ``auto``
    with tools and ``none`` without (OpenAI).

    Returns:
        None without ``tools`` (``tool_choice`` absent, ``none`` or ``auto``).

    Raises:
        ValueError: any of the above.
    """
    tools = obj.get("tools") or []
    choice = obj.get("tool_choice")
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ValueError("Parameter parallel_tool_calls must be a boolean.")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("Parameter tool_choice required or a named function needs tools.")
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"Parameter tools must list at most {MAX_TOOLS} tools, got {len(tools)}.")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("Parameter tools must not list a function name twice.")
    for i, tool in enumerate(tools):
        _check_parameters(tool["function"].get("parameters"), f"tools[{i}].function.parameters")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(tuple(tools), choice or "auto", parallel=parallel)
    name = choice["function"]["name"]
    if name not in names:
        raise ValueError(f"Parameter tool_choice names function {name[:64]!r}, which is not "
                         "in tools.")
    return ToolChoice(tuple(tools), "named", name, parallel)


def _check_parameters(schema: Any, where: str) -> None:
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object.")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where} must describe an object (type: object).")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise ValueError(f"{where} is not a valid JSON Schema: {exc.message}") from None


# --------------------------------------------------------------------------- constraint


_DEF_KEYS = ("$defs", "definitions")


def _rebased(node: Any, prefix: str) -> Any:
    r"""``node`` with its local ``$ref``\ s pointing into the root ``$defs`` under
    ``prefix`` (``#`` itself -> ``#/$defs/<prefix>``)."""
    if isinstance(node, list):
        return [_rebased(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebased(v, prefix) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        for key in _DEF_KEYS:
            if ref.startswith(f"#/{key}/"):
                out["$ref"] = f"#/$defs/{prefix}.{ref[len(key) + 3:]}"
                break
        else:
            out["$ref"] = f"#/$defs/{prefix}{ref[1:]}"
    return out


def _hoisted(params: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    r"""A tool's parameters schema moved under the wrapper: its ``$defs`` /
    ``definitions`` go to the root ``defs`` as ``<prefix>.<name>``, its local ``$ref``\ s
    follow (Pydantic-made schemas use them); the schema itself is also ``<prefix>``,
    for ``$ref: "#"``."""
    params = dict(params)
    for key in _DEF_KEYS:
        for name, sub in (params.pop(key, None) or {}).items():
            defs[f"{prefix}.{name}"] = closed_objects(_rebased(sub, prefix))
    body = closed_objects(_rebased(params, prefix))
    defs[prefix] = body
    return body


def call_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    r"""The JSON Schema of one call's JSON: ``{"name": <const>, "arguments": <the tool's
    parameters>}`` (objects closed: :func:`closed_objects`; local ``$ref``\ s rebased to
    the wrapper's root), one alternative per tool, name first, compact layout."""
    defs: dict[str, Any] = {}
    alternatives = [
        {"type": "object",
         "properties": {"name": {"const": t["function"]["name"]},
                        args_key: _hoisted(t["function"].get("parameters")
                                           or _NO_PARAMETERS, f"tool{i}", defs)},
         "required": ["name", args_key], "additionalProperties": False}
        for i, t in enumerate(tools)
    ]
    schema: dict[str, Any] = (alternatives[0] if len(alternatives) == 1
                              else {"anyOf": alternatives})
    has_refs = '"$ref"' in json.dumps(alternatives)
    return {**schema, **({"$defs": defs} if has_refs else {}), "x-guidance": _JSON_LAYOUT}


def tool_constraint(choice: ToolChoice, fmt: ToolFormat = HERMES,
                    special: Mapping[str, int] | None = None) -> StructuredOutput | None:
    """The grammar of the answer in the model's format ``fmt`` (module docstring;
    :meth:`ToolFormat.grammar`), or None for ``none``. ``special``: the format's markers
    the tokenizer holds as special tokens (``tool_formats.special_marker_ids``), written
    as those tokens."""
    if not choice.active:
        return None
    body = json.dumps(call_schema(choice.offered(), fmt.args_key), ensure_ascii=False)
    return StructuredOutput(ConstraintKind.GRAMMAR, fmt.grammar(
        body, choice.parallel and choice.mode != "named", choice.mode == "auto", special))


# --------------------------------------------------------------------------- prompt


def template_takes_tools(template: str | None) -> bool:
    """True when the chat template reads a ``tools`` variable (Hermes, Qwen, Llama 3.1
    style templates render the tools themselves); SmolLM2's does not."""
    if not template:
        return False
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def default_tool_prompt(choice: ToolChoice, fmt: ToolFormat = HERMES) -> str:
    """Our tool instructions for a template without a ``tools`` variable [I]: the tools
    as JSON lines between ``<tools>`` tags and the call format ``fmt`` (module docstring)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in choice.offered())
    rule = {
        "auto": "If no function helps, answer in plain text instead.",
        "required": "You must call at least one function.",
        "named": f"You must call the function {choice.name}.",
    }[choice.mode]
    many = ("You may call several functions."
            if choice.parallel and choice.mode != "named" and fmt.many
            else "Call one function at most.")
    example = fmt.render([("<function name>", "{<arguments as JSON>}")])
    return (
        "# Tools\n\nYou can call functions to answer the user. They are described as JSON, "
        f"one per line, between <tools> and </tools>:\n<tools>\n{listed}\n</tools>\n\n"
        f"To call a function, answer with its name and arguments in this form:\n{example}\n"
        f"{many} {rule}"
    )


def _call_block(call: dict[str, Any], fmt: ToolFormat = HERMES) -> str:
    fn = call["function"]
    return fmt.render([(fn["name"], fn["arguments"])])


def _arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    """A history call for a template: ``arguments`` as a dict when it parses to one
    (HF chat templates expect a mapping, as vLLM hands them)."""
    fn = dict(call["function"])
    try:
        parsed = json.loads(fn["arguments"])
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        fn["arguments"] = parsed
    return {**call, "function": fn}


def tool_messages(
    messages: list[dict[str, Any]], choice: ToolChoice | None, takes_tools: bool,
    fmt: ToolFormat = HERMES,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables for a chat request with tools.

    A template that ``takes_tools`` gets the messages as they are (history ``arguments``
    as dicts) and ``tools`` (unless ``tool_choice`` is ``none``). Otherwise [I] the
    default tool prompt (:func:`default_tool_prompt`) is appended to the system message
    (or becomes one), assistant ``tool_calls`` are written into the content as
    calls in the format ``fmt``, and each run of ``tool`` messages becomes one ``user``
    message of ``<tool_response>`` blocks (every template knows ``user``).

    Returns:
        (messages, template variables).
    """
    active = choice is not None and choice.active
    if takes_tools:
        out = [{**m, "tool_calls": [_arguments_object(c) for c in m["tool_calls"]]}
               if m.get("tool_calls") else m for m in messages]
        return out, ({"tools": list(choice.offered())} if active and choice else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_run"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_run": True})
            continue
        m = dict(m)
        if m.get("tool_calls"):
            blocks = "\n".join(_call_block(c, fmt) for c in m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
        out.append(m)
    for m in out:
        m.pop("_tool_run", None)
    if active and choice is not None:
        prompt = default_tool_prompt(choice, fmt)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}
