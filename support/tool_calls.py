"""Typed tools and environments (tools.py), in what runs on both sides of the worker's process
boundary: no torch here, as the worker process imports this file.

In the trainer:
  FORMATS          the two call formats: --tool-format markers (<tool>NAME ARGS</tool>) and hermes
                   (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, Qwen's)
  parse_call       the text between a call's markers, as sampled -> (name, arguments) or CallError
  check_arguments  a call's arguments against its tool's JSON schema, before the call
  tools_text       the tools' schemas as system-prompt text, for a chat template without tools=
In the worker (support/worker.py runs them as adapters: adapter(the loaded function or class, ...)):
  describe_tool, describe_environment   each tool's JSON schema, from transformers' get_json_schema
  call_tool                             one call of a function, its result as text
  env_reset, env_call, env_rewards, env_close   the environments of one decode call, one per
                                        completion, keyed by the call's session number

A tool is *plain* when it takes one parameter that is named `arguments` (typed str or not) or that
has no type hint: today's f(arguments: str) -> str, called with the text. Any other function is
*typed*: its type hints and its Google-style docstring make its schema, and it is called with
keyword arguments, checked against the schema first.
"""

import gc
import inspect
import json
import types
from dataclasses import dataclass

from support.errors import UserError


@dataclass(frozen=True)
class Format:
    """How a call is written and how its result is forced in (tools.ToolSession)."""

    name: str
    call_open: str
    call_close: str
    result_open: str  # forced before the result's text
    result_close: str  # forced after it


FORMATS = {
    "markers": Format("markers", "<tool>", "</tool>", "<result>", "</result>"),
    # Qwen2.5/Qwen3's tags. The result is forced in the same turn, right after the call: the
    # model never samples the end of its turn there, and nothing is rendered by the template again
    "hermes": Format(
        "hermes", "<tool_call>", "</tool_call>", "<tool_response>\n", "\n</tool_response>\n"
    ),
}


@dataclass(frozen=True)
class ToolSpec:
    """What the trainer knows of one tool: its JSON schema ({"type": "function", "function":
    {"name", "description", "parameters"}}, as get_json_schema writes it) and whether it is plain
    (called with one string)."""

    schema: dict
    plain: bool = False

    @property
    def name(self):
        return self.schema["function"]["name"]

    @property
    def parameters(self):
        return self.schema["function"].get("parameters", {}).get("properties", {})


class CallError(Exception):
    """A call the model wrote that cannot run: its message becomes the result, "error: ..."."""


# --------------------------------------------------------------------------------------------------
# The trainer's side: parsing and checking a call, rendering the tools.


def parse_call(body, format_name):
    """(tool name, arguments) from the text between a call's markers, as the model sampled it.
    markers: "NAME ARGS", ARGS the text after the first space (a dict is parsed later, for a typed
    tool: parse_markers_arguments). hermes: a JSON object {"name": NAME, "arguments": {...}};
    "arguments" may be left out for a tool without parameters. Raises CallError."""
    if format_name == "markers":
        name, _, arguments = body.strip().partition(" ")
        return name, arguments.strip()
    try:
        call = json.loads(body)
    except ValueError as e:
        raise CallError(f"the call is not valid JSON ({e})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise CallError('a call is a JSON object {"name": TOOL, "arguments": {...}}')
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        raise CallError(f'a call has "name" and "arguments" only, not {extra[0]!r}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # transformers #45419: a JSON string where an object belongs
        raise CallError('"arguments" must be a JSON object {"ARGUMENT": VALUE}, not a string')
    if not isinstance(arguments, dict):
        raise CallError(f'"arguments" must be a JSON object, not {json_type(arguments)}')
    return call["name"], arguments


def parse_markers_arguments(text):
    """A typed tool's arguments in the markers format: a JSON object after the name ("" for none).
    Raises CallError."""
    if not text:
        return {}
    try:
        arguments = json.loads(text)
    except ValueError as e:
        raise CallError(f"the arguments are not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise CallError(f"the arguments must be a JSON object, not {json_type(arguments)}")
    return arguments


def check_arguments(spec, arguments):
    """Raises CallError unless `arguments` (a dict) fit the tool's schema: no argument it does not
    take, every required one, each of its type (and enum, items, properties)."""
    taken, name = spec.parameters, spec.name
    for key in arguments:
        if key not in taken:
            raise CallError(
                f"{name} has no argument {key!r} (its arguments: {', '.join(taken) or 'none'})"
            )
    schema = spec.schema["function"].get("parameters", {})
    for key in schema.get("required", []):
        if key not in arguments:
            raise CallError(f"{name} needs the argument {key!r}")
    for key, value in arguments.items():
        wrong = mismatch(taken[key], value)
        if wrong is not None:
            raise CallError(f"{name}'s argument {key!r} {wrong}")


# get_json_schema's type names, as Python values after json.loads
JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def json_type(value):
    """The JSON type name of a value json.loads made."""
    if isinstance(value, bool):
        return "boolean"
    return next(
        (name for name, kinds in JSON_TYPES.items() if isinstance(value, kinds)),
        type(value).__name__,
    )


def is_type(value, name):
    """Whether a value json.loads made is of the JSON schema type `name` (a bool is no number;
    an unknown type name, "any" say, takes anything)."""
    if name not in JSON_TYPES:
        return True
    if isinstance(value, bool):
        return name == "boolean"
    return isinstance(value, JSON_TYPES[name])


def mismatch(schema, value):
    """None where `value` fits `schema` (the subset get_json_schema writes: type, nullable, enum,
    items, prefixItems, properties, required, additionalProperties), else what is wrong, in
    words."""
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        kinds += ["null"] if schema.get("nullable") else []
        if not any(is_type(value, kind) for kind in kinds):
            shown = json.dumps(value)
            return f"must be {' or '.join(kinds)}, not {json_type(value)} {shown[:40]}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {json.dumps(schema['enum'])[:80]}, not {json.dumps(value)[:40]}"
    if isinstance(value, list):
        return mismatch_items(schema, value)
    if isinstance(value, dict) and not isinstance(value, bool):
        return mismatch_properties(schema, value)
    return None


def mismatch_items(schema, value):
    """mismatch() of a list: each item against items, or a tuple's against prefixItems."""
    if "prefixItems" in schema:
        fixed = schema["prefixItems"]
        if len(value) != len(fixed):
            return f"must hold {len(fixed)} items, not {len(value)}"
        pairs = zip(fixed, value)
    else:
        pairs = ((schema.get("items", {}), item) for item in value)
    for i, (item_schema, item) in enumerate(pairs):
        wrong = mismatch(item_schema, item)
        if wrong is not None:
            return f"item {i} {wrong}"
    return None


def mismatch_properties(schema, value):
    """mismatch() of a dict: its properties, required keys and additionalProperties."""
    properties, extra = schema.get("properties", {}), schema.get("additionalProperties")
    for key in schema.get("required", []):
        if key not in value:
            return f"needs the key {key!r}"
    for key, item in value.items():
        item_schema = properties.get(key, extra if isinstance(extra, dict) else None)
        if item_schema is None and extra is False:
            return f"has no key {key!r}"
        wrong = None if item_schema is None else mismatch(item_schema, item)
        if wrong is not None:
            return f"key {key!r} {wrong}"
    return None


def tools_text(specs, format_name):
    """The tools and how to call them, as system-prompt text, for a chat template that takes no
    tools= (SmolLM2's) or no template at all: one JSON schema a line between <tools> and
    </tools>, then the call's and the result's form. Never empty: no tools, no text (the caller
    does not call it)."""
    if not specs:
        raise ValueError("tools_text needs at least one tool")
    fmt = FORMATS[format_name]
    schemas = "\n".join(json.dumps(spec.schema, ensure_ascii=False) for spec in specs)
    if format_name == "hermes":
        how = f'{fmt.call_open}{{"name": TOOL, "arguments": {{"ARGUMENT": VALUE}}}}{fmt.call_close}'
    else:
        how = f'{fmt.call_open}TOOL {{"ARGUMENT": VALUE}}{fmt.call_close}'
    return (
        "You can call the tools below, each given by its JSON schema, one a line:\n"
        f"<tools>\n{schemas}\n</tools>\n"
        f"To call a tool, write {how}. "
        f"Its result then appears as {fmt.result_open.strip()}RESULT{fmt.result_close.strip()}."
    )


# --------------------------------------------------------------------------------------------------
# The worker's side (adapters, called as adapter(fn_or_class, *args)): describing and calling.


def is_plain(fn):
    """Whether fn is today's f(arguments: str) -> str: one positional parameter, named `arguments`
    (typed str or not), or without a type hint."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: one string, as before
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 1 or params[0].kind not in positional:
        return False
    hint = params[0].annotation
    return hint is inspect.Parameter.empty or (
        params[0].name == "arguments" and hint in (str, "str")
    )


def describe_tool(fn, name=None):
    """{"schema": ..., "plain": bool} of one tool (a function, or a bound method of an
    environment), `name` its name for the model (fn's own if None). A plain tool's schema has its
    one parameter as a string; a typed tool's is transformers' get_json_schema, or a UserError
    saying what it lacks."""
    name = name or getattr(fn, "__name__", "tool")
    if is_plain(fn):
        try:
            param = next(iter(inspect.signature(fn).parameters))
        except (TypeError, ValueError, StopIteration):
            param = "arguments"
        doc = (inspect.getdoc(fn) or "").split("\n\n")[0]
        parameters = {"type": "object", "properties": {param: {"type": "string"}}}
        parameters["required"] = [param]
        schema = {"name": name, "description": " ".join(doc.split()), "parameters": parameters}
        return {"schema": {"type": "function", "function": schema}, "plain": True}
    try:
        from transformers.utils.chat_template_utils import get_json_schema
    except ImportError as e:
        raise UserError(f"a typed tool's schema needs transformers ({e})") from None
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 (get_json_schema's own exceptions, said as they are)
        raise UserError(
            f"the tool {name!r} takes typed arguments, and its JSON schema could not be made from "
            f"it: {e}. A typed tool needs a type hint on every parameter and a Google-style "
            "docstring: a description, then Args: with one line per parameter (transformers' "
            "get_json_schema reads them). A tool of one string takes it as f(arguments: str)."
        ) from None
    schema["function"]["name"] = name
    schema["function"].pop("return", None)  # the model reads the result, not its type
    return {"schema": schema, "plain": False}


def call_tool(fn, arguments, plain):
    """fn called with a call's arguments (checked already): the text for a plain tool, keywords
    for a typed one. A typed tool's value, if not a string, is written as JSON; one that is not
    JSON either stops the run (a UserError)."""
    if plain:
        return fn(arguments)
    value = fn(**arguments)
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        raise UserError(
            f"tool {getattr(fn, '__name__', '?')!r} returned a {type(value).__name__}, which is "
            "neither a string nor JSON (numbers, booleans, None, lists and dicts of them): a "
            "typed tool returns one of those. Training is saved in the output directory."
        ) from None


# The environments of the decode calls in progress: (session, index) -> instance. In the worker
# process only; env_close empties a session's.
ENVIRONMENTS = {}


def describe_environment(cls):
    """What the trainer needs of an --env class: {"tools": [describe_tool of each public method],
    "reward": its reward method's name or None, "reset": (parameter names, takes **kwargs) or
    None}. A UserError for a class it cannot use."""
    name = getattr(cls, "__name__", repr(cls))
    if not isinstance(cls, type):
        raise UserError(f"{name} is not a class: --env names a class (MODULE:CLASS)")
    try:
        required = [
            p.name
            for p in inspect.signature(cls).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if required:
        raise UserError(
            f"{name}() requires {', '.join(required)}: an environment is built with no "
            "arguments, one per completion, then reset(**the row's fields)"
        )
    reward = getattr(cls, "reward_method", None)
    if reward is not None and not inspect.isfunction(inspect.getattr_static(cls, reward, None)):
        raise UserError(f"{name}.reward_method is {reward!r}, which is not a method of {name}")
    stand_in = object()  # what a method is bound to while its schema is read
    tools = [
        describe_tool(types.MethodType(function, stand_in), method)
        for method, function in public_methods(cls)
        if method not in ("reset", reward)
    ]
    if not tools:
        raise UserError(
            f"{name} has no public method besides reset and its reward: its public methods are "
            "the tools of each completion"
        )
    reset = inspect.getattr_static(cls, "reset", None)
    if reset is not None:
        params = list(inspect.signature(reset).parameters.values())[1:]
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
        names = [(p.name, p.default is p.empty) for p in params if p.kind != p.VAR_KEYWORD]
        reset = (names, takes_all)
    return {"tools": tools, "reward": reward, "reset": reset}


def public_methods(cls):
    """[(name, function)] of the class's public instance methods, base classes' first, each in
    the order it was written (staticmethods, classmethods and properties are not tools)."""
    seen = {}
    for klass in reversed(cls.__mro__[:-1]):  # not object's
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                seen.pop(name, None)
                if inspect.isfunction(value):
                    seen[name] = value
    return list(seen.items())


def env_reset(cls, session, index, fields):
    """Build completion `index`'s environment of decode call `session`, and reset it with the row's
    fields (those reset declares: the trainer filtered them)."""
    env = cls()
    if hasattr(env, "reset"):
        env.reset(**fields)
    ENVIRONMENTS[session, index] = env


def env_call(cls, session, index, method, arguments, plain):
    """One call of a tool method of completion `index`'s environment."""
    return call_tool(getattr(ENVIRONMENTS[session, index], method), arguments, plain)


def env_rewards(cls, session, method, completions):
    """Each environment's reward method on its own completion's text: [float], in index order."""
    values = []
    for index, completion in enumerate(completions):
        value = getattr(ENVIRONMENTS[session, index], method)(completion)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)):
            raise UserError(
                f"the reward method {cls.__name__}.{method} returned a {type(value).__name__} "
                f"for completion {index}: it returns one number (a float) for its completion."
            )
        values.append(float(value))
    return values


def env_close(cls, session):
    """Drop decode call `session`'s environments (their memory goes back: a leak is the class's
    own, in module state it keeps)."""
    for key in [key for key in ENVIRONMENTS if key[0] == session]:
        del ENVIRONMENTS[key]
    gc.collect()
