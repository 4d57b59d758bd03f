#!/usr/bin/env python3
"""Writes crates/operators/data/arith_eval_pairs.json: the arith task's 500
fixed evaluation pairs, as `eval_pairs()` in ../shared/bench/trl/arith_task.py
defines them (Python's random.Random(7) shuffle of all (a, b) in 0..99²,
first 500), so weir's accuracy compares with TRL's. Standard library only."""
import json, os, random

r = random.Random(7)
pairs = [(a, b) for a in range(100) for b in range(100)]
r.shuffle(pairs)
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "operators", "data", "arith_eval_pairs.json")
with open(out, "w") as f:
    json.dump([list(p) for p in pairs[:500]], f, separators=(",", ":"))
print(out)
