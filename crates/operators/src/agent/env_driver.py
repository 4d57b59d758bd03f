# weir's Python environment worker (after python_prelude.py): loads the
# user's agent file (OpenRLHF's format: a class with reset / step, sync or
# async), then answers one JSON request per line of its stdin with one JSON
# line on its stdout.
#
# The file runs unchanged with OpenRLHF not installed: when
# `openrlhf.utils.agent` cannot be imported, a module of that name is put
# in its place, with the base classes such files import.
#
#   argv: FILE CLASS
#   requests: {"op": "reset", "id": n, "prompt": text, "label": value}
#               -> {"ok": true, "observation": text}
#             {"op": "step", "id": n, "action": text}
#               -> {"ok": true, "reward": x, "feedback": text, "done": bool,
#                   "logs": {name: number}}
#             {"op": "close", "id": n} -> {"ok": true}
#   failure:  {"ok": false, "error": "..."}
import asyncio
import inspect
import math
import types

class_name = sys.argv[2]
loop = asyncio.new_event_loop()


def settled(value):
    return loop.run_until_complete(value) if inspect.isawaitable(value) else value


def stand_in_for_openrlhf():
    try:
        import openrlhf.utils.agent  # noqa: F401

        return
    except Exception:
        pass

    class AgentInstanceBase:
        def __init__(self, *args, **kwargs):
            pass

        async def reset(self, states, **kwargs):
            return states

        async def step(self, states, **kwargs):
            raise NotImplementedError("AgentInstance.step is not implemented")

    class AgentExecutorBase:
        def __init__(self, *args, **kwargs):
            self.args = args

    class MultiTurnAgentExecutor(AgentExecutorBase):
        pass

    class SingleTurnAgentExecutor(AgentExecutorBase):
        pass

    agent = types.ModuleType("openrlhf.utils.agent")
    agent.AgentInstanceBase = AgentInstanceBase
    agent.AgentExecutorBase = AgentExecutorBase
    agent.MultiTurnAgentExecutor = MultiTurnAgentExecutor
    agent.SingleTurnAgentExecutor = SingleTurnAgentExecutor
    utils = types.ModuleType("openrlhf.utils")
    utils.agent = agent
    root = types.ModuleType("openrlhf")
    root.utils = utils
    sys.modules.update({"openrlhf": root, "openrlhf.utils": utils, "openrlhf.utils.agent": agent})


stand_in_for_openrlhf()
module = load_user_file("weir_user_environment")
cls = getattr(module, class_name, None)
if not inspect.isclass(cls):
    classes = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__)
    send({"ok": False, "error": f"it defines no class `{class_name}` (its classes: {', '.join(classes) or 'none'})"})
    sys.exit(1)
if not callable(getattr(cls, "step", None)):
    send({"ok": False, "error": f"its class `{class_name}` has no step method"})
    sys.exit(1)
send({"ready": True})


def instance():
    # OpenRLHF's examples declare `async def __init__`: run it to its end.
    obj = cls.__new__(cls)
    settled(cls.__init__(obj))
    return obj


def number(value, what):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}: it must be a finite number")
    return value


def logs(extra):
    got = {}
    for key, value in (extra or {}).items():
        try:
            got[str(key)] = number(value, key)
        except (ValueError, TypeError):
            pass
    return got


episodes = {}


def reset(req):
    agent = instance()
    prompt, label = req["prompt"], req.get("label")
    states = {"observation": prompt, "prompt": prompt, "label": label}
    result = settled(agent.reset(states))
    observation = result.get("observation", prompt) if isinstance(result, dict) else prompt
    if not isinstance(observation, str):
        raise ValueError(f"reset returned the observation {observation!r}, not text")
    episodes[req["id"]] = {"agent": agent, "text": observation, "label": label}
    return {"observation": observation}


def step(req):
    episode = episodes[req["id"]]
    action = req["action"]
    states = {
        "observation_text": episode["text"],
        "action_text": action,
        "label": episode["label"],
        "sampling_params": None,
    }
    result = settled(episode["agent"].step(states))
    if not isinstance(result, dict):
        raise ValueError(f"step returned {type(result).__name__}, not a dict")
    for key in ("rewards", "environment_feedback", "done"):
        if key not in result:
            raise ValueError(f"step returned no \"{key}\" (keys: {sorted(result)})")
    feedback = result["environment_feedback"]
    if not isinstance(feedback, str):
        raise ValueError(f"environment_feedback is {feedback!r}, not text")
    episode["text"] += action + feedback
    extra = dict(result.get("extra_logs") or {})
    if "scores" in result:
        extra.setdefault("scores", result["scores"])
    return {
        "reward": number(result["rewards"], "rewards"),
        "feedback": feedback,
        "done": bool(result["done"]),
        "logs": logs(extra),
    }


def close(req):
    episodes.pop(req["id"], None)
    return {}


for line in requests:
    request = json.loads(line)
    try:
        answer = {"reset": reset, "step": step, "close": close}[request["op"]](request)
        answer["ok"] = True
        send(answer)
    except Exception as exc:
        send({"ok": False, "error": f"{last_line(exc)}{where(exc)}"})
