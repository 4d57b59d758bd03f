# weir's Python reward worker (after python_prelude.py): loads the user's
# reward file, then answers one JSON request per line of its stdin with one
# JSON line on its stdout.
#
#   argv: FILE FUNCTION MODE   (MODE: "batch" = OpenRLHF's
#         reward_func(queries, prompts, labels, **kwargs); "sample" = verl's
#         compute_score(data_source, solution_str, ground_truth, extra_info):
#         extra_info is the file's `extra_info` column (an object) if it has
#         one, else a dict of its other columns)
#   request:  {"queries": [...], "prompts": [...], "responses": [...],
#              "labels": [...] or null, "columns": {name: [...]}}
#   answer:   {"ok": true, "rewards": [...], "logs": {name: number}}
#             {"ok": false, "error": "...", "row": i or null}
# A reward that is not a number is sent as {"bad": "<its repr>"}; NaN and
# infinities as the strings "nan", "inf", "-inf": weir names the row.
import math

name, mode = sys.argv[2], sys.argv[3]

module = load_user_file("weir_user_reward")
fn = getattr(module, name, None)
if not callable(fn):
    send({"ok": False, "error": f"it defines no function `{name}`", "row": None})
    sys.exit(1)
send({"ready": True})


def plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def number(value):
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"bad": repr(value)[:80]}
    value = float(value)
    return value if math.isfinite(value) else str(value)


def mean(value):
    value = plain(value)
    if isinstance(value, (list, tuple)):
        values = [float(v) for v in value]
        return sum(values) / len(values) if values else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def logs(extra):
    got = {}
    for key, value in (extra or {}).items():
        m = mean(value)
        if m is not None and math.isfinite(m):
            got[str(key)] = m
    return got


def batch(req):
    labels = req["labels"]
    kwargs = dict(req["columns"])
    result = plain(fn(req["queries"], req["prompts"], labels if labels is not None else [None] * len(req["queries"]), **kwargs))
    extra = {}
    if isinstance(result, dict):
        if "rewards" not in result:
            raise ValueError(f"returned a dict without \"rewards\" (keys: {sorted(result)})")
        extra = dict(result.get("extra_logs") or {})
        if "scores" in result:
            extra.setdefault("scores", result["scores"])
        result = plain(result["rewards"])
    if not isinstance(result, (list, tuple)):
        raise ValueError(f"returned {type(result).__name__}, not a list of rewards")
    return [number(r) for r in result], logs(extra)


def decoded(text):
    # A column that held a JSON object or list arrives as its JSON text.
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, (dict, list)) else text


def sample(req):
    rewards, extras = [], {}
    labels = req["labels"]
    columns = req["columns"]
    for i, response in enumerate(req["responses"]):
        info = {key: values[i] for key, values in columns.items() if key != "data_source"}
        if "extra_info" in columns:
            # verl's datasets carry extra_info as an object: it is the argument.
            info = decoded(columns["extra_info"][i])
        source = columns["data_source"][i] if "data_source" in columns else ""
        try:
            score = fn(source, response, labels[i] if labels is not None else None, info)
        except Exception as exc:
            exc.weir_row = i
            raise
        if isinstance(score, dict):
            for key, value in score.items():
                if key != "score":
                    extras.setdefault(key, []).append(value)
            score = score.get("score")
        rewards.append(number(score))
    return rewards, logs({k: v for k, v in extras.items() if all(isinstance(x, (int, float)) for x in v)})


for line in requests:
    request = json.loads(line)
    try:
        rewards, extra = (batch if mode == "batch" else sample)(request)
        send({"ok": True, "rewards": rewards, "logs": extra})
    except Exception as exc:
        send({"ok": False, "error": f"{last_line(exc)}{where(exc)}", "row": getattr(exc, "weir_row", None)})
