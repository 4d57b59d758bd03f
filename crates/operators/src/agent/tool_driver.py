# weir's Python tool worker (after python_prelude.py): loads a function
# from the user's file, tells its JSON schema (from its signature and
# docstring, as transformers' get_json_schema reads them), then answers one
# JSON request per line of its stdin with one JSON line on its stdout.
#
#   argv: FILE FUNCTION
#   requests: {"op": "schema"} -> {"ok": true, "schema": {...}}
#             {"op": "call", "arguments": {...}} -> {"ok": true, "output": text}
#   failure:  {"ok": false, "error": "..."}
import inspect
import re
import typing

name = sys.argv[2]

module = load_user_file("weir_user_tool")
fn = getattr(module, name, None)
if not callable(fn):
    send({"ok": False, "error": f"it defines no function `{name}`"})
    sys.exit(1)

PLAIN = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def json_type(annotation, param):
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return json_type(kinds[0], param)
        return {"anyOf": [json_type(a, param) for a in kinds]}
    if origin in (list, typing.List):
        args = typing.get_args(annotation)
        return {"type": "array", **({"items": json_type(args[0], param)} if args else {})}
    if origin in (dict, typing.Dict):
        return {"type": "object"}
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {"type": PLAIN.get(type(values[0]), "string"), "enum": values}
    if annotation in PLAIN:
        return {"type": PLAIN[annotation]}
    raise ValueError(f"parameter `{param}` has the type {annotation!r}, which has no JSON schema")


def schema():
    doc = inspect.getdoc(fn) or ""
    parts = re.split(r"\n\s*\n", doc, maxsplit=1)
    description = " ".join(parts[0].split()) if doc else ""
    if not description:
        raise ValueError("it has no docstring to describe it")
    described = {}
    section = re.search(r"(?ms)^\s*(Args|Arguments|Parameters):\s*\n(.*?)(?:^\s*(Returns|Raises|Yields|Examples?):|\Z)", doc)
    if section:
        for line in section.group(2).splitlines():
            m = re.match(r"\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", line)
            if m:
                described[m.group(1)] = m.group(3).strip()
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise ValueError(f"parameter `{param.name}` has no type annotation")
        prop = json_type(hints[param.name], param.name)
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


try:
    own_schema = schema()
except Exception as exc:
    send({"ok": False, "error": last_line(exc)})
    sys.exit(1)
send({"ready": True})


def text(value):
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


for line in requests:
    request = json.loads(line)
    try:
        if request["op"] == "schema":
            send({"ok": True, "schema": own_schema})
        else:
            send({"ok": True, "output": text(fn(**request["arguments"]))})
    except Exception as exc:
        send({"ok": False, "error": f"{last_line(exc)}{where(exc)}"})
