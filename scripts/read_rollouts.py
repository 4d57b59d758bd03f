"""A weir run's rollout log read with polars and with DuckDB.

    .venv/bin/python scripts/read_rollouts.py RUN_DIR

Prints, per step, the rows, the mean reward and the mean response length
(polars), then how many prompts some response solved (DuckDB, in SQL).
docs/rollout-log.md explains the columns; a test runs this on a real run.
"""

import sys

import duckdb
import polars as pl

run = sys.argv[1]
files = f"{run}/rollouts/*.parquet"

rows = pl.read_parquet(files)
per_step = (
    rows.group_by("step")
    .agg(
        pl.len().alias("rows"),
        pl.col("reward").mean().alias("reward"),
        pl.col("response_tokens").list.len().mean().alias("response_length"),
    )
    .sort("step")
)
for r in per_step.iter_rows(named=True):
    print(
        f"polars step={r['step']} rows={r['rows']} "
        f"reward={r['reward']:.6f} response_length={r['response_length']:.6f}"
    )

best = duckdb.sql(
    f"""
    SELECT prompt_id, max(reward) AS best, count(*) AS samples
    FROM read_parquet('{files}')
    GROUP BY prompt_id
    """
).fetchall()
solved = sum(1 for _, top, _ in best if top >= 1.0)
print(f"duckdb prompts={len(best)} solved={solved}")
